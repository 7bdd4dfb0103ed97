"""Iterative RL inside `grpo train` (DeepSeekMath, arXiv 2402.03300, §4.2 and Algorithm 1).

    grpo train +recipe=iterative                     # 3 iterations x 10 steps, a learned ORM, SmolLM2 on CPU
    grpo train +recipe=iterative iterative.iterations=2 trainer.max_steps=20

The training loop builds an `IterativeRL` only when iterative.iterations = I > 0 (otherwise its reward
is `build(cfg.reward)` for the whole run). It gives the loop the reward of each step; with I iterations
of M = iterative.steps steps, the first step of iteration i (step i*M + 1) first:
  1. draws rm.num_problems training problems (seeded by trainer.seed, rm.seed and i; the prompt
     stream's position is not touched) and rm.samples_per_problem completions of each from the
     current policy (adapter on), at iterative.temperature;
  2. labels them (`labeler`) and holds out the rows of rm.heldout_fraction of the prompts: fresh
     samples of the current policy the reward model has not seen;
  3. mixes the new training rows with a replay share (rm.replay.share) of earlier iterations' rows
     (`ReplayBuffer`, RUN/rm/replay/iteration_NNN.jsonl);
  4. continues training the reward model (the previous iteration's; at iteration 0
     reward.name_or_path, or a new head on the policy's base when that is null) on the mix, scoring
     the held-out rows before and after; saves it to RUN/rm/iteration_NNN/, and the steps of
     iteration i are scored by it, unless the gate below keeps the previous model;
  5. sets the reference policy to the current policy (`policy.set_reference`: a frozen copy of the
     LoRA adapter; two adapters however many iterations run), so the KL of that step is 0.
One record per iteration (rows, replay counts, held-out accuracy/AUC before and after) goes to
RUN/iterations.jsonl and a table; every step's metrics carry `iteration`. The number the paper's reason
for iterating implies (an old reward model stops ranking the new policy's samples) is logged at each
boundary, in the record and in that step's metrics.jsonl record: `rm/auc_current_policy_before`, the
AUC of the model that scored the last iteration on fresh samples of the policy it produced (the held-out
rows, labeled by the rule); `rm/auc_current_policy_after`, the retrained model's on the same rows; and
`rm/auc_current_policy`, the one of the model that scores this iteration (after, unless the gate kept the
previous model). None where the rows hold one class; at iteration 0 from a new head, "before" is the
untrained head's. Checkpoints hold the
iteration count, the reward model's folder (relative to RUN), the replay state and the reference
adapter (checkpoint `reference/`), so a resume mid-iteration or at a boundary is exact.

The gate (rm.min_auc, issue #28): a reward model must rank before it rewards. When the retrained model's
AUC on the held-out rows (fresh samples of the current policy, labeled by the rule) is below rm.min_auc,
the iteration keeps the model that scored the previous one, says so in one line and records
`kept_previous`; the rejected model is kept for inspection in RUN/rm/rejected/iteration_NNN/ (outside
rm/iteration_*, which eval reads as the run's reward models), and the next iteration trains the kept
model further. There is nothing to keep at iteration 0 from a new head (reward.name_or_path=null): the
new model is used and the line says so. Held-out rows of one class have no AUC: the gate cannot judge,
and the retrained model is used.

Guards against the reward model's blind spots that GRPO amplifies (issue #28; the measured run's policy
learned to ramble past the length cap because its reward model liked long text):
  - iterative.truncated_reward: a completion cut at sampler.max_new_tokens gets this reward instead of
    the model's score (`floor_truncated`), so it scores as the worst answer: a fixed floor, not the
    batch's lowest score, because a floor is the same whatever else was sampled (the batch minimum ties a
    truncated completion with the worst finished one, and moves with it). 0 is below every sigmoid score;
    a PRM's truncated completion gets one step, at its last step's end, of that reward.
  - the reward given to the policy is the model's score centered per group, not scaled by the group's
    std: algo.advantage_scale=none (recipes/iterative_from_rm.yaml), so an advantage is score - group mean and a
    preference of 0.01 moves the policy by 0.01, where the paper's group std would blow it up to ~1.
    Centering in the reward itself would change nothing: the advantage subtracts the group mean anyway.
  - iterative.length_alarm (`length_shift`): each step's metrics carry iterative/length_shift (the mean
    completion length relative to the iteration's first step's) and iterative/truncated_shift (the
    truncated share minus the first step's); iterative/length_alarm is 1 when either moves by more than
    the setting, and the first such step of an iteration prints one line. A function of the steps'
    records (the checkpoint's history), so a resume gives the same numbers.

iterative.retrain=false is the control the paper's reason for iterating implies (scripts/iterative_vs_fixed.py):
iteration 0 trains the reward model as above, and every later boundary samples, labels and measures that same model
on fresh samples of the current policy (rm/auc_current_policy_before; rows in RUN/rm/measured/iteration_NNN/) and
resets the reference, but trains nothing: the same steps and samples, one reward model.

Departures from Algorithm 1: the paper resets the reference at the start of an iteration and
retrains the reward model at its end, starting from a given model; here both happen at the start of
an iteration, so iteration 0 trains the first reward model on the initial policy's samples (a given
reward.name_or_path is trained further there too). The reward model's samples may use their own
temperature (a rarely-right policy at temperature 1 gives almost only negative labels).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch
from hydra.utils import get_object
from omegaconf import DictConfig
from rich.table import Table

from grpo_cli import checkpoint, rm
from grpo_cli.checks import Check, Rule, is_int, is_num, raised
from grpo_cli.errors import ConfigError, RunError
from grpo_cli.instantiate import build
from grpo_cli.metrics.console import console
from grpo_cli.policy import resolve_dtype, set_reference
from grpo_cli.rewards import RewardResult

# the reward config each labeler kind needs, as `reward=OPTION` names it
_REWARD = {"outcome": ("grpo_cli.rewards.models.outcome_reward_model", "orm"),
           "process": ("grpo_cli.rewards.models.process_reward_model", "prm")}


def floor_truncated(result: RewardResult, truncated: list[bool], completions: list[str],
                    value: float | None) -> RewardResult:
    """`result` with every truncated completion's reward set to `value` (None: `result` as it is).

    Outcome: the reward is `value`. Process: the steps become one step of reward `value` at the last scored
    step's end (or the completion's end when none was scored), so the process advantage gives every token
    of it the same, lowest return. `per_function` keeps the model's raw scores, for the metrics.
    """
    if value is None or not any(truncated):
        return result
    rewards = [value if cut else r for r, cut in zip(result.rewards, truncated, strict=True)]
    steps = result.steps
    if steps is not None:
        steps = [s if not cut else [(s[-1][0] if s else len(c), value)] if s or c else []
                 for s, cut, c in zip(steps, truncated, completions, strict=True)]
        rewards = [sum(r for _, r in s) if s else None for s in steps]
    return dataclasses.replace(result, rewards=rewards, steps=steps)


class FlooredReward:
    """A built reward whose truncated completions score `value` (`floor_truncated`); the rollout's
    `truncated` column says which."""

    def __init__(self, reward, value: float):
        self.reward, self.value = reward, value

    def __call__(self, prompts: list[str], completions: list[str], columns: dict | None = None) -> RewardResult:
        result = self.reward(prompts, completions, columns)
        return floor_truncated(result, list((columns or {})["truncated"]), list(completions), self.value)


def check_settings(cfg: DictConfig) -> None:
    """What iterative RL needs beyond each value's own rule: one ConfigError listing every problem."""
    it = cfg.get("iterative")
    if not it or not it.iterations:
        return
    errors = []
    # steps or iterations of the wrong type have their own line (CHECKS); no product of them to suggest then
    counts_ok = is_int(it.iterations) and is_int(it.steps) and it.steps >= 1
    if counts_ok and cfg.trainer.max_steps != it.iterations * it.steps:
        errors.append(f"trainer.max_steps ({cfg.trainer.max_steps}) must equal iterative.iterations x iterative.steps "
                      f"({it.iterations} x {it.steps}); set trainer.max_steps={it.iterations * it.steps}")

    kind = getattr(get_object(cfg.labeler._target_), "kind", None)
    target, option = _REWARD.get(kind, (None, None))
    if target is None:
        errors.append(f"labeler ({cfg.labeler._target_}) gives neither outcome nor process labels; "
                      f"use labeler=outcome")
    elif cfg.reward.get("_target_") != target:
        errors.append(f"iterative RL retrains the reward model, so the reward must be one: the labeler gives {kind} "
                      f"labels, so set reward={option} (reward.name_or_path=null starts from a new head)")
    try:
        rm.check_settings(cfg.rm)
    except ConfigError as err:
        errors.append(str(err))
    if errors:
        raise ConfigError("\n".join(errors))


class IterativeRL:
    """The boundaries between iterations and the reward model that scores each step (iterative.iterations > 0)."""

    def __init__(self, cfg: DictConfig, run_dir: Path):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.count, self.steps, self.temperature = int(cfg.iterative.iterations), int(cfg.iterative.steps), \
            cfg.iterative.temperature
        self.labeler = build(cfg.labeler)
        self.replay = rm.ReplayBuffer(self.run_dir / "rm" / "replay", cfg.rm.replay.share, cfg.rm.seed)
        self.done = 0  # iterations whose boundary has run
        start = cfg.reward.get("name_or_path")
        self.model: str | None = str(start) if start else None  # the reward model now scoring
        self.history: list[dict] = []
        self._reward = None
        self._dataset = None

    def iteration(self, step: int) -> int:
        return (step - 1) // self.steps

    def reward_for(self, step: int, policy, tokenizer):
        """The reward function that scores `step`; at an iteration's first step, first the boundary."""
        if (step - 1) % self.steps == 0 and self.iteration(step) >= self.done:
            self.boundary(self.iteration(step), step, policy, tokenizer)
        if self._reward is None:  # resumed mid-iteration: the reward model the checkpoint names
            self._reward = build(self.cfg.reward, name_or_path=self.model)
            floor = self.cfg.iterative.truncated_reward
            if floor is not None:
                self._reward = FlooredReward(self._reward, floor)
        return self._reward

    def length_shift(self, record: dict, history: list[dict]) -> dict:
        """The length-shift alarm's metrics for `record` (a step's metrics), against the first step of its
        iteration (in `history`, the earlier steps' records, or `record` itself); {} with the alarm off."""
        limit = self.cfg.iterative.length_alarm
        if limit is None:
            return {}
        step, i = record["step"], self.iteration(record["step"])
        first = i * self.steps + 1
        earlier = [r for r in history if first <= r["step"] < step]
        base = next((r for r in earlier if r["step"] == first), record)
        length, base_length = record["completions/mean_length"], base["completions/mean_length"]
        cut, base_cut = record["completions/clipped_ratio"], base["completions/clipped_ratio"]
        shift = (length - base_length) / max(base_length, 1.0)
        alarm = abs(shift) > limit or abs(cut - base_cut) > limit
        if alarm and not any(r.get("iterative/length_alarm") for r in earlier):
            console.print(f"[yellow]step {step}: the completions moved within iteration {i}: mean length "
                          f"{base_length:.1f} -> {length:.1f} ({shift:+.0%}), truncated {base_cut:.0%} -> {cut:.0%}, "
                          f"more than iterative.length_alarm={limit}; the reward model may be paying for length")
        return {"iterative/length_shift": shift, "iterative/truncated_shift": cut - base_cut,
                "iterative/length_alarm": int(alarm)}

    def _seed(self, i: int) -> int:
        return ((self.cfg.trainer.seed * 1_000_003 + self.cfg.rm.seed) * 1_000_003 + i) % 2**63

    def boundary(self, i: int, step: int, policy, tokenizer) -> dict:
        """Sample, label, retrain the reward model with replay, reference <- policy; returns the record."""
        cfg, settings = self.cfg, self.cfg.rm
        started = time.time()
        seed = self._seed(i)
        if self._dataset is None:
            self._dataset = build(cfg.data).train
        sampler = build(cfg.sampler, **({"temperature": self.temperature} if self.temperature else {}))
        console.print(f"iteration {i} (steps {step}-{step + self.steps - 1}): sampling {settings.num_problems} "
                      f"problems x {settings.samples_per_problem} from the current policy for the reward model")
        # the step's own sampling stays a function of (seed, step): the boundary draws from a forked RNG
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            problems = rm.pick_problems(self._dataset, settings.num_problems, seed)
            samples = rm.draw_samples(policy, tokenizer, sampler, problems, settings.samples_per_problem,
                                      settings.prompts_per_batch)
            rows = self.labeler(samples, policy=policy, tokenizer=tokenizer, sampler=sampler)
            sampled = time.time()
            if not rows:
                raise RunError(f"iteration {i}: the labeler kept no rows of {len(samples)} samples (no reference "
                               f"answers, or no step it could label); check data and labeler")
            kind = rm.check_rows(rows, f"iteration {i} labels")
            train_rows, heldout = rm.split_heldout(rows, settings.heldout_fraction, seed)
            mix, info = self.replay.mix(i, train_rows)
            if not mix:
                raise RunError(f"iteration {i}: no rows to train the reward model on; raise rm.num_problems or "
                               f"lower rm.heldout_fraction")
            device = next(policy.parameters()).device
            model, rm_tokenizer = rm.starting_classifier(self.model, kind, cfg.model.loader, device,
                                                        resolve_dtype(cfg.model.dtype, device), seed=seed)
            # iterative.retrain=false (the fixed arm): after iteration 0 the model is only measured on the fresh rows
            retrain = i == 0 or self.model is None or bool(cfg.iterative.retrain)
            if retrain:
                model, trained = rm.retrain(model, rm_tokenizer, mix, heldout, settings, kind, seed=seed)
            else:
                before = rm.evaluate(model, rm_tokenizer, heldout, kind=kind, template=settings.template,
                                     batch_size=settings.batch_size) if heldout else None
                trained = {"heldout_before": before, "heldout_after": None, "train_loss_first": None,
                           "train_loss_last": None, "pos_weight": None}
        if retrain:
            after = trained["heldout_after"] or {}
            keep_previous = self._gate(i, step, after.get("auc"), settings.min_auc, len(heldout))
            folder = self.run_dir / "rm" / ("rejected" if keep_previous else "") / f"iteration_{i:03d}"
            rm.save_reward_model(model, rm_tokenizer, folder, {"kind": kind, "template": settings.template,
                                                              "iteration": i, "step": step,
                                                              "heldout": trained["heldout_after"],
                                                              "kept_previous": keep_previous})
        else:  # nothing trained: the rows are kept beside the model they measured
            keep_previous, folder = True, self.run_dir / "rm" / "measured" / f"iteration_{i:03d}"
            folder.mkdir(parents=True, exist_ok=True)
            console.print(f"iteration {i}: iterative.retrain=false, the reward model of iteration 0 scores steps "
                          f"{step}-{step + self.steps - 1} (measured on {len(heldout)} fresh held-out rows)")
        del model
        held = {r["prompt"] for r in heldout}
        rm.write_jsonl(folder / "labeled.jsonl", [{**r, "split": "heldout" if r["prompt"] in held else "train"}
                                                 for r in rows])
        self.replay.add(i, rows)  # after training, as grpo rm does: a failed boundary leaves the buffer as it was
        set_reference(policy)
        positives = sum(r["label"] >= 0.5 for r in rows) if kind == "outcome" else None
        record = {"iteration": i, "step": step, "samples": len(samples), "rows": len(rows), "positives": positives,
                  "train_new": info["new"], "train_replay": info["replay"], "replay_share": info["share"],
                  "heldout": len(heldout), "rm_start": self.model,
                  # the model that scores this iteration's steps, and the one this boundary trained
                  "rm": self._relative(self.model if keep_previous else folder),
                  "rm_trained": str(folder.relative_to(self.run_dir)), "min_auc": settings.min_auc,
                  "kept_previous": keep_previous, "retrained": retrain, **trained,
                  "time/sample_s": round(sampled - started, 1),
                  "time/rm_s": round(time.time() - sampled, 1)}
        before, after = (trained["heldout_before"] or {}).get("auc"), (trained["heldout_after"] or {}).get("auc")
        record.update({"rm/auc_current_policy_before": before, "rm/auc_current_policy_after": after,
                       "rm/auc_current_policy": before if keep_previous else after})
        self.history.append(record)
        self._write_history()
        self.model = self.model if keep_previous else str(folder)
        self.done, self._reward = i + 1, None
        console.print(history_table(self.history))
        return record

    def metrics(self, step: int) -> dict:
        """What `step`'s metrics.jsonl record carries from a boundary run at it (none inside an iteration)."""
        for r in self.history:
            if r["step"] == step:
                return {"rm/auc_current_policy_before": r["rm/auc_current_policy_before"],
                        "rm/auc_current_policy_after": r["rm/auc_current_policy_after"],
                        "rm/auc_current_policy": r["rm/auc_current_policy"],
                        "rm/kept_previous": int(r["kept_previous"])}
        return {}

    def _gate(self, i: int, step: int, auc: float | None, min_auc: float | None, heldout: int) -> bool:
        """Whether iteration i keeps the previous reward model: the retrained one's AUC on its `heldout` rows
        is below rm.min_auc and there is a previous one. One console line whenever the bar is set and not
        cleared."""
        if min_auc is None:
            return False
        steps = f"steps {step}-{step + self.steps - 1}"
        if not heldout:
            console.print(f"[yellow]iteration {i}: no held-out rows (rm.heldout_fraction=0), so rm.min_auc={min_auc} "
                          f"cannot judge the retrained reward model; it scores {steps}")
            return False
        if auc is None:
            console.print(f"[yellow]iteration {i}: the held-out rows hold one class only, so the retrained reward "
                          f"model has no AUC and rm.min_auc={min_auc} cannot judge it; it scores {steps}")
            return False
        if auc >= min_auc:
            return False
        if self.model is None:
            console.print(f"[yellow]iteration {i}: the retrained reward model's held-out AUC {auc:.3f} is below "
                          f"rm.min_auc={min_auc}, but there is no previous model to keep (a new head); it scores "
                          f"{steps}")
            return False
        console.print(f"[yellow]iteration {i}: the retrained reward model's held-out AUC {auc:.3f} is below "
                      f"rm.min_auc={min_auc}: keeping the previous one ({self.model}) for {steps}")
        return True

    def _relative(self, path: str | Path) -> str:
        """A path under the run folder relative to it (as checkpoints record it), any other as it is."""
        path = Path(path)
        return str(path.relative_to(self.run_dir)) if path.is_relative_to(self.run_dir) else str(path)

    def _write_history(self) -> None:
        rm.write_jsonl(self.run_dir / "iterations.jsonl", self.history)

    def state_dict(self) -> dict:
        """{"iterative": ...} for trainer_state.json. Paths relative to the run folder."""
        model = Path(self.model) if self.model else None
        if model is not None and model.is_relative_to(self.run_dir):
            model = model.relative_to(self.run_dir)
        return {"iterative": {"done": self.done, "rm": None if model is None else str(model),
                              "replay": {**self.replay.state_dict(), "folder": "rm/replay"},
                              "history": self.history}}

    def load_state_dict(self, state: dict, policy, ckpt: Path) -> None:
        """Restore from a checkpoint's trainer_state and reference adapter."""
        it = state.get("iterative")
        if it is None:
            raise ConfigError(f"{ckpt} holds no iterative state; it was not trained with iterative.iterations > 0")
        self.done, self.history = int(it["done"]), list(it["history"])
        if self.done:  # the reward model of the last boundary, in the run folder
            self.model = str(self.run_dir / it["rm"])
        self.replay.load_state_dict(it["replay"])
        self._write_history()  # a resume from an older checkpoint drops the later iterations' records
        self._reward = None
        if self.done and not checkpoint.load_reference(policy, ckpt):
            raise ConfigError(f"{ckpt} has no reference/ adapter after {self.done} iterations; use another checkpoint")


def history_table(history: list[dict]) -> Table:
    """One row per iteration: the reward model on fresh held-out samples of the policy, before/after retraining."""
    table = Table(title="iterative RL: the reward model on held-out samples of the current policy")
    for col in ("iter", "step", "rows (right)", "new+replay", "held-out", "before acc/AUC", "after acc/AUC", "scores",
                "time"):
        table.add_column(col, justify="right")
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    for r in history:
        b, a = r["heldout_before"] or {}, r["heldout_after"] or {}
        table.add_row(str(r["iteration"]), str(r["step"]), f"{r['rows']} ({r['positives']})",
                      f"{r['train_new']}+{r['train_replay']}", str(r["heldout"]),
                      f"{fmt(b.get('accuracy'))}/{fmt(b.get('auc'))}",
                      f"{fmt(a.get('accuracy'))}/{fmt(a.get('auc'))}",
                      "previous" if r.get("kept_previous") else "retrained",
                      f"{r['time/sample_s'] + r['time/rm_s']:.0f} s")
    return table


def read_history(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "iterations.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

# ---- config checks: this module's settings, collected by config.validate --------------------------------

CHECKS: list[Check] = [
    Rule("iterative.iterations", lambda v: is_int(v) and v >= 0,
         "must be an integer >= 0 (0: off); set iterative.iterations=0"),
    Rule("iterative.steps", lambda v: is_int(v) and v >= 1, "must be an integer >= 1; set iterative.steps=10"),
    Rule("iterative.temperature", lambda v: v is None or (is_num(v) and v > 0),
         "must be > 0 or null (sampler.temperature); set iterative.temperature=null"),
    Rule("iterative.retrain", lambda v: isinstance(v, bool),
         "must be true (retrain the reward model at every iteration) or false (keep iteration 0's); "
         "set iterative.retrain=true"),
    Rule("iterative.truncated_reward", lambda v: v is None or is_num(v),
         "must be a number (the reward of a truncated completion; 0 is below every sigmoid score) or null (off); "
         "set iterative.truncated_reward=0.0"),
    Rule("iterative.length_alarm", lambda v: v is None or (is_num(v) and v > 0),
         "must be > 0 (the relative mean-length change or the truncated-share change that sounds the alarm) or "
         "null (off); set iterative.length_alarm=0.25"),
    raised(check_settings),
]
