"""The guard (`trainer.guard`): tripwires that read each step's record, and the rewind when one fires.

    trip = fired(run)                     # after step n (and its eval): the first tripwire that fires, or None
    run, last, halt = rewind(run, trip)   # back to the last checkpoint that passed, its remedy applied
    run = resume(run, ckpt)               # grpo train resume=: recipe.resume, then the guard's decisions since

The tripwires are pure functions of the run's history (trainer_state.json's list of step records, the in-run evals'
numbers included), each with its threshold (conf/train.yaml, trainer.guard; docs/watching.md):

  heldout_drop   the in-run eval's Wilson 95% interval lies wholly below the best eval's so far: the gate
  logp_gap       sampler/logp_gap (vLLM's log-probs against the trainer's) above a threshold
  entropy        the mean token entropy below a share of its mean over the run's first steps
  length         the mean completion length, or the truncated share, jumps above its running mean
  nonfinite      steps in a row whose loss or gradient was not finite (each one skipped by the update)

When one fires the run goes back to the newest checkpoint that passed every tripwire: one written before the
firing step and, while the held-out tripwire is on and the run has evals, no newer than its newest eval (a
checkpoint past it has not been through one). A stop goes to the best evaluated checkpoint that passed instead: the
run ends there. The exact-resume machinery loads it (`recipe.resume`: weights,
optimizer, scheduler, prompt stream, reward schedule, RNG), then the remedy applies: the learning rate x a factor,
`algo.is_correction` switched to a stricter mode, or stop. Each decision is a line of RUN/guard.jsonl; the guard's
state (decisions made, rewinds done, the learning-rate scale, the correction in force) is part of trainer_state.json,
so a resume goes on with the decisions the run had made, also the ones made after its newest checkpoint.

Order on disk at a rewind: the newer checkpoints are set aside first, then the decision is written. A run killed
between the two resumes at the checkpoint, redoes its steps and fires again as it did; killed after, it resumes at
the checkpoint and applies the decision it finds there (`pending`).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from grpo_cli import checkpoint, files, recipe
from grpo_cli.algo import build_loss
from grpo_cli.checks import Check, is_int, is_num, one_of
from grpo_cli.errors import RunError
from grpo_cli.metrics.console import console, quiet
from grpo_cli.objective import IS_CORRECTIONS

DECISIONS = "guard.jsonl"


@dataclass(frozen=True)
class Trip:
    """A tripwire that fired at `step`: the numbers that fired it (for guard.jsonl) and what they say (the line)."""

    tripwire: str
    step: int
    values: dict
    why: str


# ---- the tripwires: history (step records, oldest first; the newest is the step just done) -> Trip or None ----------

def heldout_drop(history: list[dict]) -> Trip | None:
    """The newest step's eval interval [low, high] lies wholly below the best earlier eval's: high < best's low.

    Two intervals that do not overlap are the plainest evidence of a drop the eval can see; a point estimate outside
    the other's interval would fire on the default job's own noise (0.590 after 0.655 on 200 problems: 0.52-0.66
    against 0.59-0.72). Ties for the best: the earliest."""
    now = history[-1] if history else {}
    if "eval/accuracy" not in now:
        return None
    earlier = [r for r in history[:-1] if "eval/accuracy" in r]
    if not earlier:
        return None
    best = max(earlier, key=lambda r: r["eval/accuracy"])  # max keeps the first of equal scores
    if not now["eval/accuracy_high"] < best["eval/accuracy_low"]:
        return None
    values = {"accuracy": now["eval/accuracy"], "low": now["eval/accuracy_low"], "high": now["eval/accuracy_high"],
              "best_step": best["step"], "best_accuracy": best["eval/accuracy"],
              "best_low": best["eval/accuracy_low"], "best_high": best["eval/accuracy_high"]}
    why = (f"held-out accuracy {now['eval/accuracy']:.3f} ({now['eval/accuracy_low']:.2f}-"
           f"{now['eval/accuracy_high']:.2f}) below the best, {best['eval/accuracy']:.3f} at step {best['step']} "
           f"({best['eval/accuracy_low']:.2f}-{best['eval/accuracy_high']:.2f})")
    return Trip("heldout_drop", now["step"], values, why)


def logp_gap(history: list[dict], max: float) -> Trip | None:  # noqa: A002 (the YAML key's name)
    """sampler/logp_gap of the newest step above `max` (logged only when the sampler gives its own log-probs)."""
    gap = history[-1].get("sampler/logp_gap") if history else None
    if gap is None or not gap > max:
        return None
    return Trip("logp_gap", history[-1]["step"], {"logp_gap": gap, "max": max},
                f"sampler/logp_gap {gap:.3g} above {max:g}")


def _updated(record: dict) -> bool:
    """The step updated some token: its entropy is a measurement (0 when no row was updated: groups tied, β = 0)."""
    return record.get("counts/backward_seqs", 1) > 0 and "entropy" in record


def entropy(history: list[dict], min_ratio: float, window: int) -> Trip | None:
    """The newest step's mean token entropy below `min_ratio` x its mean over the first `window` steps that
    updated tokens (the run's early entropy); nothing before that many steps, nor at a step that updated none."""
    measured = [r for r in history if _updated(r)]
    if len(measured) <= window or not _updated(history[-1]):
        return None
    early = sum(r["entropy"] for r in measured[:window]) / window
    now = history[-1]["entropy"]
    if not now < min_ratio * early:
        return None
    return Trip("entropy", history[-1]["step"], {"entropy": now, "early": early, "min_ratio": min_ratio},
                f"entropy {now:.3g} below {min_ratio:g} x its early mean {early:.3g}")


def length(history: list[dict], max_ratio: float | None, max_truncated_rise: float | None,
           window: int) -> Trip | None:
    """The newest step's completions/mean_length above `max_ratio` x its mean over the previous `window` steps, or
    its completions/clipped_ratio (the truncated share) above that mean + `max_truncated_rise`. A half set to None
    is off."""
    if len(history) <= window:
        return None
    now, before = history[-1], history[-1 - window:-1]
    mean_length = sum(r["completions/mean_length"] for r in before) / window
    truncated = sum(r["completions/clipped_ratio"] for r in before) / window
    values = {"mean_length": now["completions/mean_length"], "baseline_length": mean_length,
              "truncated": now["completions/clipped_ratio"], "baseline_truncated": truncated}
    if max_ratio is not None and now["completions/mean_length"] > max_ratio * mean_length:
        why = (f"mean length {now['completions/mean_length']:.1f} above {max_ratio:g} x its running mean "
               f"{mean_length:.1f}")
    elif max_truncated_rise is not None and now["completions/clipped_ratio"] > truncated + max_truncated_rise:
        why = (f"truncated share {now['completions/clipped_ratio']:.2f} above its running mean {truncated:.2f} + "
               f"{max_truncated_rise:g}")
    else:
        return None
    return Trip("length", now["step"], values, why)


def nonfinite(history: list[dict], steps: int) -> Trip | None:
    """The newest `steps` steps each skipped an optimizer step for a non-finite loss or gradient."""
    streak = 0
    for record in reversed(history):
        if not record.get("nonfinite_skipped"):
            break
        streak += 1
    if streak < steps:
        return None
    return Trip("nonfinite", history[-1]["step"], {"steps_in_a_row": streak},
                f"{streak} steps in a row with a non-finite loss or gradient")


# in the order they are read: the held-out gate first; one trip a step
TRIPWIRES = {"heldout_drop": heldout_drop, "nonfinite": nonfinite, "logp_gap": logp_gap, "entropy": entropy,
             "length": length}
REMEDIES = ("lr", "is_correction", "stop")
# thresholds a tripwire may have at null (that half off), as long as one of them is set
OPTIONAL = {"length": ("max_ratio", "max_truncated_rise")}
REMEDY_KEYS = ("remedy", "lr_factor", "is_correction", "is_correction_cap")


def thresholds(name: str) -> list[str]:
    """A tripwire's threshold keys: its function's parameters after the history."""
    return list(inspect.signature(TRIPWIRES[name]).parameters)[1:]


# ---- the guard's state and its decisions ----------------------------------------------------------------------------

@dataclass(frozen=True)
class GuardState:
    """What the guard has decided so far; trainer_state.json's "guard" (checkpoints of a run before any decision, and
    runs saved before the guard existed, lack it: the start)."""

    decisions: int = 0                      # lines of guard.jsonl this state includes
    rewinds: int = 0                        # rewinds that went on training (trainer.guard.max_rewinds bounds them)
    lr_scale: float = 1.0                   # the product of the lr remedies' factors applied
    is_correction: str | None = None        # the is_correction remedy's mode in force; None: algo's own
    is_correction_cap: float | None = None  # its cap

    @staticmethod
    def of(guard: dict | None) -> GuardState:
        """The state trainer_state's `guard` holds (TrainerState.guard); the start where it holds none."""
        return GuardState(**guard) if guard is not None else GuardState()


@dataclass(frozen=True)
class Decision:
    """One line of guard.jsonl: which tripwire fired at which step, its numbers, where the run went and what changed.
    `rewound_to` None: no checkpoint had passed (the run stopped where it was)."""

    step: int
    tripwire: str
    values: dict
    rewound_to: int | None
    remedy: str                                   # lr, is_correction or stop
    rewind: int                                   # the rewinds done after it (stop: unchanged)
    max_rewinds: int
    changes: dict = field(default_factory=dict)   # lr_factor, or is_correction and is_correction_cap


def decide(trip: Trip, node, state: GuardState, max_rewinds: int, target: int | None, algo_cap,
           best: int | None = None) -> Decision:
    """What the guard does about `trip`: the tripwire's remedy, or stop when the rewinds are spent or no checkpoint
    passed. `node`: the tripwire's settings; `algo_cap`: algo.is_correction_cap (the remedy's own cap where null).
    `target`: the newest checkpoint that passed, where a rewind that trains on goes; `best`: the best evaluated one
    that passed (`stop_target`), where a stop goes, since the run ends there."""
    remedy = node["remedy"]
    if target is None or state.rewinds >= max_rewinds:
        remedy = "stop"
    if remedy == "stop" and best is not None:
        target = best
    changes = {}
    if remedy == "lr":
        changes = {"lr_factor": float(node["lr_factor"])}
    elif remedy == "is_correction":
        cap = node.get("is_correction_cap") if algo_cap is None else algo_cap
        changes = {"is_correction": node["is_correction"], "is_correction_cap": float(cap)}
    rewinds = state.rewinds + (remedy != "stop")
    return Decision(trip.step, trip.tripwire, trip.values, target, remedy, rewinds, max_rewinds, changes)


def after(state: GuardState, decision: dict) -> GuardState:
    """The guard's state once `decision` (a guard.jsonl line) is applied."""
    changes = decision["changes"]
    return GuardState(decisions=state.decisions + 1, rewinds=decision["rewind"],
                      lr_scale=state.lr_scale * changes.get("lr_factor", 1.0),
                      is_correction=changes.get("is_correction", state.is_correction),
                      is_correction_cap=changes.get("is_correction_cap", state.is_correction_cap))


def rewind_target(checkpoints: list[int], history: list[dict], step: int, gated: bool) -> int | None:
    """The step of the newest checkpoint that passed every tripwire, of those on disk (`checkpoints`), or None: one
    before `step` (the firing step's is never written) and, when the held-out tripwire gates the run (`gated`), no
    newer than its newest eval before `step` (a checkpoint past that has not been through the gate yet)."""
    evals = [r["step"] for r in history if "eval/accuracy" in r and r["step"] < step]
    newest = max(evals) if gated and evals else step - 1
    return max((c for c in checkpoints if c <= newest), default=None)


def stop_target(checkpoints: list[int], history: list[dict], step: int, gated: bool) -> int | None:
    """Where a run that stops goes: of the checkpoints on disk that passed (`rewind_target`'s rule), the one whose
    in-run eval scored highest (the earliest of equal scores, as best.json and the gate pick); the newest that passed
    where none of them was evaluated. A stop ends the run, so it ends at its best, not at a newer checkpoint that
    passed the gate by its interval but scored lower (the planted fault: 0.390 at step 20 against 0.480 at step 10)."""
    newest = rewind_target(checkpoints, history, step, gated)
    if newest is None:
        return None
    scored = [r for r in history if "eval/accuracy" in r and r["step"] <= newest and r["step"] in checkpoints]
    return max(scored, key=lambda r: r["eval/accuracy"])["step"] if scored else newest


def pending(decisions: list[dict], done: int, step: int) -> list[dict]:
    """The decisions a resume from checkpoint `step` applies: those after the `done` its state includes that rewound
    to it (made after it was written, by a run killed before its next checkpoint). A later one that rewound elsewhere
    belongs to a branch the resume abandons, and so does everything after it."""
    out = []
    for decision in decisions[done:]:
        if decision["rewound_to"] != step:
            break
        out.append(decision)
    return out


def check(guard: DictConfig, history: list[dict], state: GuardState) -> Trip | None:
    """The first tripwire of `guard` (trainer.guard) that fires at the newest step of `history`. A tripwire whose
    is_correction remedy is in force stays quiet: firing again would change nothing."""
    for name, tripwire in TRIPWIRES.items():
        node = guard.get(name)
        if node is None:
            continue
        if node.get("remedy") == "is_correction" and state.is_correction == node.get("is_correction"):
            continue
        trip = tripwire(history, **{key: node[key] for key in thresholds(name)})
        if trip is not None:
            return trip
    return None


# ---- the run: fire, rewind, resume ----------------------------------------------------------------------------------

def fired(run: recipe.Run) -> Trip | None:
    """A tripwire that fires at the run's newest step (every rank reads the same history: the same verdict)."""
    guard = run.cfg.trainer.get("guard")
    if not guard:
        return None
    return check(guard, run.state.history, GuardState.of(run.state.guard))


def rewind(run: recipe.Run, trip: Trip) -> tuple[recipe.Run, Path, bool]:
    """Act on `trip`: back to the newest checkpoint that passed, the remedy applied, the decision in guard.jsonl and
    one console line. Returns (the run, now at that checkpoint; its folder; whether the run stops there). With no
    checkpoint that passed, a RunError (its line, the decision written)."""
    world, guard = run.world, run.cfg.trainer.guard
    state = GuardState.of(run.state.guard)
    gated = guard.get("heldout_drop") is not None and bool(run.heldout)
    target = best = None
    if world.main:
        found = [checkpoint.step_of(p) for p in checkpoint.list_checkpoints(run.run_dir)]
        target = rewind_target(found, run.state.history, trip.step, gated)
        best = stop_target(found, run.state.history, trip.step, gated)
    target, best = world.broadcast((target, best))
    decision = decide(trip, guard[trip.tripwire], state, guard.max_rewinds, target, run.cfg.algo.is_correction_cap,
                      best)
    line = dataclasses.asdict(decision)
    target = decision.rewound_to  # a stop's is the best that passed, not the newest
    if target is None:
        if world.main:
            write_decision(run.run_dir, line, state.decisions)
        raise RunError(f"guard: step {trip.step}: {trip.why}, before any checkpoint passed (trainer.save_every, "
                       f"trainer.eval_every): nothing to rewind to; the run stops. Lower optimizer.lr, or turn the "
                       f"tripwire off (trainer.guard.{trip.tripwire}=null), and start a new run")
    ckpt = checkpoint.checkpoint_dir(run.run_dir, target)
    if world.main:  # first the newer checkpoints go, then the decision is written (the module's docstring says why)
        checkpoint.set_aside_after(run.run_dir, target)
        run.log.truncate(target)
        run.samples.truncate(target)
        write_decision(run.run_dir, line, state.decisions)
    run.state.guard = None  # the checkpoint's own (absent before its run's first decision) comes back
    with quiet():  # the guard's one line says it
        recipe.resume(run, ckpt)
    run = apply(run, GuardState.of(run.state.guard), after(state, line))
    console.print(f"[yellow]guard: step {trip.step}: {trip.why}; {said(line)}", highlight=False)
    return run, ckpt, decision.remedy == "stop"


def said(decision: dict) -> str:
    """What a decision did, for the console line."""
    where = f"rewound to step {decision['rewound_to']}"
    changes = decision["changes"]
    if decision["remedy"] == "lr":
        return f"{where}, learning rate x{changes['lr_factor']:g} (rewind {decision['rewind']} of " \
               f"{decision['max_rewinds']})"
    if decision["remedy"] == "is_correction":
        return (f"{where}, algo.is_correction={changes['is_correction']} with cap {changes['is_correction_cap']:g} "
                f"(rewind {decision['rewind']} of {decision['max_rewinds']})")
    spent = decision["rewind"] >= decision["max_rewinds"]
    why = f"trainer.guard.max_rewinds={decision['max_rewinds']} spent" if spent else "its remedy is stop"
    return f"{where} and stopped ({why})"


def resume(run: recipe.Run, ckpt: Path) -> recipe.Run:
    """`recipe.resume` for `grpo train resume=`, with the guard's state: the checkpoint's, and the decisions made after
    it (`pending`); guard.jsonl keeps the lines of the branch that goes on."""
    run.state.guard = None
    recipe.resume(run, ckpt)
    loaded = GuardState.of(run.state.guard)
    lines = read_decisions(run.run_dir)
    state = loaded
    for decision in pending(lines, loaded.decisions, run.state.step):
        state = after(state, decision)
    if state != loaded:
        console.print(f"guard: {state.decisions - loaded.decisions} decision(s) made after this checkpoint: "
                      f"{said(lines[state.decisions - 1])}", highlight=False)
    if run.world.main and len(lines) > state.decisions:  # an abandoned branch's decisions
        write_lines(run.run_dir, lines[:state.decisions])
    return apply(run, loaded, state)


def apply(run: recipe.Run, loaded: GuardState, state: GuardState) -> recipe.Run:
    """The run, its optimizer and scheduler loaded from a checkpoint whose guard state was `loaded`, going on with
    `state`: the learning rate scaled by state's scale over the checkpoint's (the lr the files hold had the
    checkpoint's), and the loss rebuilt with the correction in force. The next checkpoint holds both."""
    ratio = state.lr_scale / loaded.lr_scale
    if ratio != 1.0:
        for group in run.optimizer.param_groups:
            group["lr"] *= ratio
            if "initial_lr" in group:
                group["initial_lr"] *= ratio
        # the schedule multiplies base_lrs (LambdaLR); _last_lr is the lr the step's record logs
        run.scheduler.base_lrs = [lr * ratio for lr in run.scheduler.base_lrs]
        run.scheduler._last_lr = [lr * ratio for lr in run.scheduler.get_last_lr()]
    run.state.guard = dataclasses.asdict(state)
    if state.is_correction is None:
        return run
    loss = build_loss(run.cfg.algo, is_correction=state.is_correction, is_correction_cap=state.is_correction_cap)
    return dataclasses.replace(run, loss=loss)


# ---- RUN/guard.jsonl -----------------------------------------------------------------------------------------------

def read_decisions(run_dir: Path) -> list[dict]:
    """The decisions of RUN/guard.jsonl, in order; reading stops at a line that is not one (a file damaged by hand:
    one warning line, and the rest are dropped at the next write)."""
    file = Path(run_dir) / DECISIONS
    if not file.exists():
        return []
    out = []
    keys = {f.name for f in dataclasses.fields(Decision)}
    for line in file.read_text(errors="replace").splitlines():
        try:
            decision = json.loads(line)
            ok = (isinstance(decision, dict) and keys <= decision.keys() and isinstance(decision["changes"], dict)
                  and (decision["rewound_to"] is None or is_int(decision["rewound_to"]))
                  and is_int(decision["rewind"]))
        except ValueError:
            ok = False
        if not ok:
            console.print(f"[yellow]{file}: a line that is not a guard decision; the decisions after it are not read")
            break
        out.append(decision)
    return out


def write_decision(run_dir: Path, decision: dict, done: int) -> None:
    """Append `decision` as the guard's line number `done` + 1 (lines past `done`, an abandoned branch's, go)."""
    write_lines(run_dir, [*read_decisions(run_dir)[:done], decision])


def write_lines(run_dir: Path, decisions: list[dict]) -> None:
    """RUN/guard.jsonl holding `decisions`, replaced atomically: a kill leaves the old file or the new, whole."""
    files.write_text(Path(run_dir) / DECISIONS, "".join(json.dumps(d) + "\n" for d in decisions))


# ---- config checks: trainer.guard, collected by config.validate through grpo train's CHECKS -------------------------

def _tripwire_problems(name: str, node, cfg: DictConfig) -> list[str]:
    """One tripwire's settings: its thresholds, its remedy and the remedy's parameter."""
    key = f"trainer.guard.{name}"
    if not isinstance(node, DictConfig):
        return [f"{key} ({node!r}) must be a mapping of its settings or null (off); drop the override"]
    known = [*thresholds(name), *REMEDY_KEYS]
    errors = [f"{key}.{k} is not a setting of this tripwire; its settings are {one_of(known)}"
              for k in node if k not in known]
    errors += [f"{key}.{k} is missing; set +{key}.{k}=... (conf/train.yaml has the defaults)"
               for k in thresholds(name) if k not in node]
    optional = OPTIONAL.get(name, ())
    if optional and all(k in node and node[k] is None for k in optional):
        names = " and ".join(f"{key}.{k}" for k in optional)
        errors.append(f"{names} are all null, so it never fires; set {key}=null to turn it off, or one of them as "
                      f"conf/train.yaml does")
    for k in thresholds(name):
        value = node.get(k)
        whole = k in ("window", "steps")
        if k in optional and value is None:
            continue
        if k in node and not (is_int(value) and value >= 1 if whole else is_num(value) and value > 0):
            kind = "an integer >= 1" if whole else "a number > 0" + (" or null (off)" if k in optional else "")
            errors.append(f"{key}.{k} ({value!r}) must be {kind}; set {key}.{k} as conf/train.yaml does")
    remedy = node.get("remedy")
    if remedy not in REMEDIES:
        return [*errors, f"{key}.remedy ({remedy!r}) must be {one_of(REMEDIES)}; set {key}.remedy=lr"]
    if remedy == "lr" and not (is_num(node.get("lr_factor")) and node.get("lr_factor") > 0):
        errors.append(f"{key}.remedy=lr needs its factor: {key}.lr_factor ({node.get('lr_factor')!r}) must be a "
                      f"number > 0; set {'+' if 'lr_factor' not in node else ''}{key}.lr_factor=0.5")
    if remedy == "is_correction":
        mode, cap = node.get("is_correction"), node.get("is_correction_cap")
        if mode not in IS_CORRECTIONS:
            errors.append(f"{key}.remedy=is_correction needs its mode: {key}.is_correction ({mode!r}) must be "
                          f"{one_of(IS_CORRECTIONS)}; set {'+' if 'is_correction' not in node else ''}"
                          f"{key}.is_correction=sequence_mask")
        if cfg.algo.get("is_correction_cap") is None and not (is_num(cap) and cap >= 1):
            errors.append(f"{key}.remedy=is_correction needs a cap, and algo.is_correction_cap is null: "
                          f"{key}.is_correction_cap ({cap!r}) must be >= 1; set "
                          f"{'+' if 'is_correction_cap' not in node else ''}{key}.is_correction_cap=3")
    return errors


def guard_problems(cfg: DictConfig) -> list[str]:
    """trainer.guard: null, or max_rewinds and known tripwires, each null or well set; the non-finite tripwire fires
    before trainer.max_nonfinite_steps stops the run."""
    guard = OmegaConf.select(cfg, "trainer.guard")
    if guard is None:
        return []
    if not isinstance(guard, DictConfig):
        return [f"trainer.guard ({guard!r}) must be the guard's settings or null (no guard); drop the override"]
    errors = []
    if not (is_int(guard.get("max_rewinds")) and guard.get("max_rewinds") >= 0):
        errors.append(f"trainer.guard.max_rewinds ({guard.get('max_rewinds')!r}) must be an integer >= 0; set "
                      f"trainer.guard.max_rewinds=2")
    for name in guard:
        if name == "max_rewinds":
            continue
        if name not in TRIPWIRES:
            errors.append(f"trainer.guard.{name} is not a tripwire; the tripwires are {one_of(TRIPWIRES)}: drop it")
        elif guard[name] is not None:
            errors += _tripwire_problems(str(name), guard[name], cfg)
    steps, most = OmegaConf.select(cfg, "trainer.guard.nonfinite.steps"), cfg.trainer.get("max_nonfinite_steps")
    if is_int(steps) and is_int(most) and steps > most:
        errors.append(f"trainer.guard.nonfinite.steps ({steps}) is more than trainer.max_nonfinite_steps ({most}), "
                      f"which stops the run first; set trainer.guard.nonfinite.steps={most}")
    return errors


CHECKS: list[Check] = [guard_problems]
