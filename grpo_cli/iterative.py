"""Iterative RL inside `grpo train` (DeepSeekMath, arXiv 2402.03300, §4.2 and Algorithm 1): a reward schedule.

    grpo train +recipe=iterative                     # 3 iterations x 10 steps, a learned ORM, SmolLM2 on CPU
    grpo train +recipe=iterative iterative.iterations=2 trainer.max_steps=20

`IterativeRL` is the reward schedule (`grpo_cli.reward_schedule`) of a run with iterative.iterations = I > 0.
With M = iterative.steps, the first step of iteration i (step i*M + 1) first runs a boundary, in phases:
  1. sample: rm.num_problems training problems (seeded by trainer.seed, rm.seed and i; the prompt stream is
     not touched), rm.samples_per_problem completions each from the current policy (adapter on);
  2. label (`labeler`), hold out the rows of rm.heldout_fraction of the prompts, mix the new training rows
     with a replay share (rm.replay.share) of earlier iterations' rows (`rm.ReplayBuffer`);
  3. train: continue training the reward model (the previous iteration's; at iteration 0
     reward.name_or_path, or a new head on the policy's base) on the mix, scoring the held-out rows before
     and after (iterative.retrain=false: after iteration 0 only measure);
  4. gate (rm.min_auc): a retrained model whose within-prompt AUC on the held-out rows (`rm.within_prompt_auc`)
     is below the bar, or unmeasurable because no held-out prompt's samples hold both labels, is set aside and the
     previous one goes on scoring;
  5. save the model and its rows, reference policy <- current policy (`policy.set_reference`), record the
     iteration (RUN/iterations.jsonl and a table).
The steps of iteration i are scored by that model, floored for truncated completions
(iterative.truncated_reward: the step's shaping, `rewards.shaping.shape`). Each step's record carries `iteration`,
the boundary's AUCs on its first step, and the length-shift alarm (iterative.length_alarm).
docs/iterative-rl.md says what each setting guards against and what was measured.

Departures from Algorithm 1: the paper resets the reference at the start of an iteration and retrains the
reward model at its end, starting from a given model; here both happen at the start of an iteration, so
iteration 0 trains the first reward model on the initial policy's samples (a given reward.name_or_path is
trained further there too). The reward model's samples may use their own temperature.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hydra.utils import get_object
from omegaconf import DictConfig
from rich.table import Table

from grpo_cli import checkpoint, rm
from grpo_cli.checks import Check, Rule, is_int, is_num, raised
from grpo_cli.errors import ConfigError, RunError
from grpo_cli.metrics.console import console
from grpo_cli.policy import resolve_dtype, set_reference

# the reward config each labeler kind needs, as `reward=OPTION` names it
_REWARD = {"outcome": ("grpo_cli.rewards.models.outcome_reward_model", "orm"),
           "process": ("grpo_cli.rewards.models.process_reward_model", "prm")}


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


@dataclass(frozen=True)
class RewardModelTrainer:
    """How a boundary builds, trains and measures a reward model: the `rm` settings, and the policy's base loader
    and precision for a new head (DeepSeekMath starts reward models from the policy's base)."""

    settings: DictConfig  # the `rm` section
    loader: DictConfig    # model.loader: the base of a new head
    dtype: str            # model.dtype

    def start(self, init: str | None, kind: str, device: torch.device, seed: int):
        """(model, tokenizer): the reward model in folder `init`, or a new head on the base."""
        return rm.starting_classifier(init, kind, self.loader, device, resolve_dtype(self.dtype, device), seed=seed)

    def train(self, model, tokenizer, mix: list[dict], heldout: list[dict], kind: str, seed: int):
        """(merged model, report with the held-out metrics before and after)."""
        return rm.retrain(model, tokenizer, mix, heldout, self.settings, kind, seed=seed)

    def measure(self, model, tokenizer, heldout: list[dict], kind: str) -> dict:
        """`train`'s report for a model that is only measured (iterative.retrain=false)."""
        before = rm.evaluate(model, tokenizer, heldout, kind=kind, template=self.settings.template,
                             batch_size=self.settings.batch_size) if heldout else None
        return {"heldout_before": before, "heldout_after": None, "train_loss_first": None, "train_loss_last": None,
                "pos_weight": None}


@dataclass(frozen=True)
class Samples:
    """One boundary's labeled samples of the current policy."""

    samples: list[dict]
    rows: list[dict]
    kind: str                 # outcome or process labels
    train: list[dict]         # the new rows mixed with replayed ones
    heldout: list[dict]       # rows of held-out prompts: fresh samples the reward model does not train on
    replay: dict              # ReplayBuffer.mix's counts
    seconds: float


class IterativeRL:
    """The reward schedule of iterative RL: the boundaries between iterations and the reward model of each step.

    Built by the train command from its parts: `settings` (the `iterative` section), `rm_settings` (`rm`), the
    labeler, the training problems, a sampler for the reward model's samples, `reward_model(path)` (the reward
    that a reward-model folder gives, as `reward=orm|prm` builds it) and the reward-model trainer.
    """

    def __init__(self, settings: DictConfig, rm_settings: DictConfig, *, run_dir: Path, seed: int, labeler,
                 problems, sampler, reward_model: Callable[[str | None], Any], trainer: RewardModelTrainer,
                 start: str | None):
        self.settings, self.rm_settings, self.run_dir, self.seed = settings, rm_settings, Path(run_dir), seed
        self.count, self.steps = int(settings.iterations), int(settings.steps)
        self.labeler, self.problems, self.sampler = labeler, problems, sampler
        self.reward_model, self.trainer = reward_model, trainer
        self.replay = rm.ReplayBuffer(self.run_dir / "rm" / "replay", rm_settings.replay.share, rm_settings.seed)
        self.done = 0  # iterations whose boundary has run
        self.model: str | None = str(start) if start else None  # the reward model now scoring
        self.history: list[dict] = []
        self._reward = None

    # ---- the reward schedule ------------------------------------------------------------------------

    def check(self, example: dict, keep) -> None:
        """Nothing to check before the model loads: the reward model is trained at the first boundary."""

    def begin(self, step: int, policy, tokenizer) -> tuple[Any, dict]:
        """The reward that scores `step` (at an iteration's first step, after the boundary) and its tags."""
        if (step - 1) % self.steps == 0 and self.iteration(step) >= self.done:
            self.boundary(self.iteration(step), step, policy, tokenizer)
        if self._reward is None:  # resumed mid-iteration: the reward model the checkpoint names
            self._reward = self.reward_model(self.model)
        # at a boundary also the reward models' AUC on fresh samples of the current policy (before/after)
        return self._reward, {"iteration": self.iteration(step), **self.metrics(step)}

    def after(self, record: dict, history: list[dict]) -> dict:
        """The length-shift alarm: mean length and truncated share against the iteration's first step."""
        return self.length_shift(record, history)

    @property
    def truncated_reward(self) -> float | None:
        """The floor of a truncated completion's reward (iterative.truncated_reward; None: off)."""
        return self.settings.truncated_reward

    def iteration(self, step: int) -> int:
        return (step - 1) // self.steps

    def length_shift(self, record: dict, history: list[dict]) -> dict:
        """The length-shift alarm's metrics for `record` (a step's metrics), against the first step of its
        iteration (in `history`, the earlier steps' records, or `record` itself); {} with the alarm off."""
        limit = self.settings.length_alarm
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

    # ---- a boundary, phase by phase -------------------------------------------------------------------

    def _seed(self, i: int) -> int:
        return ((self.seed * 1_000_003 + self.rm_settings.seed) * 1_000_003 + i) % 2**63

    def boundary(self, i: int, step: int, policy, tokenizer) -> dict:
        """Sample, label, retrain the reward model with replay, gate, reference <- policy; returns the record."""
        seed = self._seed(i)
        console.print(f"iteration {i} (steps {step}-{step + self.steps - 1}): sampling "
                      f"{self.rm_settings.num_problems} problems x {self.rm_settings.samples_per_problem} from the "
                      f"current policy for the reward model")
        started = time.time()
        # the step's own sampling stays a function of (seed, step): the boundary draws from a forked RNG
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            drawn = self._sample(i, policy, tokenizer, seed)
            device = next(policy.parameters()).device
            model, rm_tokenizer = self.trainer.start(self.model, drawn.kind, device, seed)
            # iterative.retrain=false (the fixed arm): after iteration 0 the model is only measured on the fresh rows
            retrain = i == 0 or self.model is None or bool(self.settings.retrain)
            if retrain:
                model, trained = self.trainer.train(model, rm_tokenizer, drawn.train, drawn.heldout, drawn.kind, seed)
            else:
                trained = self.trainer.measure(model, rm_tokenizer, drawn.heldout, drawn.kind)
        keep_previous, folder = self._keep(i, step, retrain, trained, drawn, model, rm_tokenizer)
        del model
        held = {r["prompt"] for r in drawn.heldout}
        rm.write_jsonl(folder / "labeled.jsonl", [{**r, "split": "heldout" if r["prompt"] in held else "train"}
                                                 for r in drawn.rows])
        # after training, as grpo rm does: a failed boundary leaves the buffer as it was
        self.replay.add(i, drawn.rows)
        set_reference(policy)
        record = self._record(i, step, drawn, trained, retrain, keep_previous, folder,
                              rm_seconds=time.time() - started - drawn.seconds)
        self.history.append(record)
        self._write_history()
        self.model = self.model if keep_previous else str(folder)
        self.done, self._reward = i + 1, None
        console.print(history_table(self.history))
        return record

    def _sample(self, i: int, policy, tokenizer, seed: int) -> Samples:
        """Phases 1-2: the current policy's samples, labeled, split into training (with replay) and held-out rows."""
        settings, started = self.rm_settings, time.time()
        problems = rm.pick_problems(self.problems, settings.num_problems, seed)
        samples = rm.draw_samples(policy, tokenizer, self.sampler, problems, settings.samples_per_problem,
                                  settings.prompts_per_batch)
        rows = self.labeler(samples, policy=policy, tokenizer=tokenizer, sampler=self.sampler)
        seconds = time.time() - started
        if not rows:
            raise RunError(f"iteration {i}: the labeler kept no rows of {len(samples)} samples (no reference "
                           f"answers, or no step it could label); check data and labeler")
        kind = rm.check_rows(rows, f"iteration {i} labels")
        train_rows, heldout = rm.split_heldout(rows, settings.heldout_fraction, seed)
        mix, info = self.replay.mix(i, train_rows)
        if not mix:
            raise RunError(f"iteration {i}: no rows to train the reward model on; raise rm.num_problems or "
                           f"lower rm.heldout_fraction")
        return Samples(samples, rows, kind, mix, heldout, info, seconds)

    def _keep(self, i: int, step: int, retrain: bool, trained: dict, drawn: Samples, model,
              tokenizer) -> tuple[bool, Path]:
        """Phases 4-5: the gate, and where the boundary's model (or its measured rows) is saved."""
        if not retrain:  # nothing trained: the rows are kept beside the model they measured
            folder = self.run_dir / "rm" / "measured" / f"iteration_{i:03d}"
            folder.mkdir(parents=True, exist_ok=True)
            console.print(f"iteration {i}: iterative.retrain=false, the reward model of iteration 0 scores steps "
                          f"{step}-{step + self.steps - 1} (measured on {len(drawn.heldout)} fresh held-out rows)")
            return True, folder
        after = trained["heldout_after"] or {}
        keep_previous, line = gate(i, f"steps {step}-{step + self.steps - 1}", after.get("auc_within_prompt"),
                                   self.rm_settings.min_auc, len(drawn.heldout), self.model)
        if line:
            console.print(f"[yellow]{line}")
        folder = self.run_dir / "rm" / ("rejected" if keep_previous else "") / f"iteration_{i:03d}"
        rm.save_reward_model(model, tokenizer, folder, {"kind": drawn.kind, "template": self.rm_settings.template,
                                                        "iteration": i, "step": step,
                                                        "heldout": trained["heldout_after"],
                                                        "kept_previous": keep_previous})
        return keep_previous, folder

    def _record(self, i: int, step: int, drawn: Samples, trained: dict, retrain: bool, keep_previous: bool,
                folder: Path, rm_seconds: float) -> dict:
        """The iteration's line of RUN/iterations.jsonl."""
        rows, info = drawn.rows, drawn.replay
        positives = sum(r["label"] >= 0.5 for r in rows) if drawn.kind == "outcome" else None
        record = {"iteration": i, "step": step, "samples": len(drawn.samples), "rows": len(rows),
                  "positives": positives, "train_new": info["new"], "train_replay": info["replay"],
                  "replay_share": info["share"], "heldout": len(drawn.heldout), "rm_start": self.model,
                  # the model that scores this iteration's steps, and the one this boundary trained
                  "rm": self._relative(self.model if keep_previous else folder),
                  "rm_trained": str(folder.relative_to(self.run_dir)), "min_auc": self.rm_settings.min_auc,
                  "kept_previous": keep_previous, "retrained": retrain, **trained,
                  "time/sample_s": round(drawn.seconds, 1), "time/rm_s": round(rm_seconds, 1)}
        # the gate's number, within-prompt (what GRPO's groups see), and the pooled AUC beside it
        before, after = trained["heldout_before"] or {}, trained["heldout_after"] or {}
        record.update({"rm/auc_current_policy_before": before.get("auc_within_prompt"),
                       "rm/auc_current_policy_after": after.get("auc_within_prompt"),
                       "rm/auc_current_policy": (before if keep_previous else after).get("auc_within_prompt"),
                       "rm/auc_prompts": before.get("auc_prompts"),
                       "rm/pooled_auc_current_policy_before": before.get("auc"),
                       "rm/pooled_auc_current_policy_after": after.get("auc")})
        return record

    def metrics(self, step: int) -> dict:
        """What `step`'s metrics.jsonl record carries from a boundary run at it (none inside an iteration)."""
        for r in self.history:
            if r["step"] == step:
                keys = ("rm/auc_current_policy_before", "rm/auc_current_policy_after", "rm/auc_current_policy",
                        "rm/auc_prompts", "rm/pooled_auc_current_policy_before", "rm/pooled_auc_current_policy_after")
                # a run saved before the within-prompt AUC lacks its keys
                return {**{k: r.get(k) for k in keys}, "rm/kept_previous": int(r["kept_previous"])}
        return {}

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
    """One row per iteration: the reward model on fresh held-out samples of the policy, before/after retraining
    (AUC within prompt: the gate's number; the prompts with both labels it rests on)."""
    table = Table(title="iterative RL: the reward model on held-out samples of the current policy")
    for col in ("iter", "step", "rows (right)", "new+replay", "held-out (prompts)", "before acc/AUC",
                "after acc/AUC", "scores", "time"):
        table.add_column(col, justify="right")
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    for r in history:
        b, a = r["heldout_before"] or {}, r["heldout_after"] or {}
        table.add_row(str(r["iteration"]), str(r["step"]), f"{r['rows']} ({r['positives']})",
                      f"{r['train_new']}+{r['train_replay']}", f"{r['heldout']} ({b.get('auc_prompts', '-')})",
                      f"{fmt(b.get('accuracy'))}/{fmt(b.get('auc_within_prompt'))}",
                      f"{fmt(a.get('accuracy'))}/{fmt(a.get('auc_within_prompt'))}",
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


def gate(i: int, steps: str, auc: float | None, min_auc: float | None, heldout: int,
         previous: str | None) -> tuple[bool, str | None]:
    """(whether iteration i keeps the `previous` reward model, the console line saying why or None). `auc` is the
    retrained model's within-prompt AUC on its `heldout` rows (GRPO only uses the ranking within a group), None when
    no held-out prompt's samples hold both labels. With rm.min_auc set, a model not shown to clear it (below the
    bar, or unmeasurable) keeps the previous one when there is one; a line whenever the bar is not cleared. With no
    held-out rows at all (rm.heldout_fraction=0) the retrained model is used, and said. `steps` names the steps the
    chosen model scores."""
    if min_auc is None or (auc is not None and heldout and auc >= min_auc):
        return False, None
    if not heldout:
        return False, (f"iteration {i}: no held-out rows (rm.heldout_fraction=0), so rm.min_auc={min_auc} cannot "
                       f"judge the retrained reward model; it scores {steps}")
    why = (f"no held-out prompt's samples hold both labels, so the retrained reward model has no within-prompt AUC "
           f"and rm.min_auc={min_auc} cannot validate it" if auc is None else
           f"the retrained reward model's held-out within-prompt AUC {auc:.3f} is below rm.min_auc={min_auc}")
    if previous is None:
        return False, f"iteration {i}: {why}; there is no previous model to keep (a new head): it scores {steps}"
    return True, f"iteration {i}: {why}: keeping the previous one ({previous}) for {steps}"
