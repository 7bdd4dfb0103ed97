"""The shape of the JSON files grpo train writes into a run folder, checked when they are read back (a run folder
is data: docs/runs.md): a checkpoint's trainer_state.json, optimizer.json and scheduler.json (checkpoint.verify), and
the run's best.json (checkpoint.read_best). A file that parses but is not what grpo train writes is named by its key.
"""

from __future__ import annotations

import math


def _int(low: int = 0):
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _list_of(check, length: int | None = None):
    return lambda v: isinstance(v, list) and all(check(x) for x in v) and (length is None or len(v) == length)


def _is(kind):
    return lambda v: isinstance(v, kind)


# (dotted key, required, check, what it must be) of each JSON file grpo train writes; a key that a checkpoint older
# than it lacks is optional. A key under another is checked only when that one holds an object.
SHAPES = {
    # RUN/best.json (checkpoint.record_best); that "checkpoint" is its step's own folder is checkpoint.read_best's
    "best.json": [
        ("step", True, _int(), "an integer >= 0"),
        ("checkpoint", True, _is(str), "a string"),
        ("metric", True, _is(str), "a string"),
        ("score", True, lambda v: _number(v) and math.isfinite(v), "a finite number"),
    ],
    "trainer_state.json": [
        ("step", True, _int(), "an integer >= 0"),
        ("history", True, _list_of(_is(dict)), "a list of objects"),
        ("data", True, _is(dict), "an object"),
        ("data.position", True, _int(), "an integer >= 0"),
        ("data.seed", False, _int(), "an integer >= 0"),
        ("data.size", False, _int(), "an integer >= 0"),
        ("world_size", False, _int(1), "an integer >= 1"),
        ("dtype", False, _is(str), "a string"),
        ("started_in", False, _is(str), "a string"),
        ("rng", False, _is(dict), "an object"),
        ("rng.torch", True, _list_of(lambda b: _int()(b) and b < 256), "a list of integers (bytes)"),
        ("iterative", False, _is(dict), "an object"),
        ("iterative.done", True, _int(), "an integer >= 0"),
        ("iterative.history", True, _is(list), "a list"),
        ("iterative.replay", True, _is(dict), "an object"),
        ("iterative.rm", False, lambda v: v is None or isinstance(v, str), "a path or null"),
        # the rollouts in flight when it was saved (algo.max_staleness > 0, grpo_cli/rollout/ahead.py)
        ("ahead", False, _is(dict), "an object"),
        # the guard's decisions so far (grpo_cli.guard.GuardState); absent before a run's first
        ("guard", False, _is(dict), "an object"),
        ("guard.decisions", True, _int(), "an integer >= 0"),
        ("guard.rewinds", True, _int(), "an integer >= 0"),
        ("guard.lr_scale", True, lambda v: _number(v) and math.isfinite(v) and v > 0, "a number > 0"),
        ("guard.is_correction", True, lambda v: v is None or isinstance(v, str), "a mode or null"),
        ("guard.is_correction_cap", True, lambda v: v is None or _number(v), "a number or null"),
    ],
    "optimizer.json": [
        ("param_groups", True, lambda v: _list_of(_is(dict))(v) and len(v) > 0, "a non-empty list of objects"),
        ("state", True, lambda v: isinstance(v, dict) and all(isinstance(s, dict) for s in v.values()),
         "an object of objects"),
    ],
    "scheduler.json": [
        ("last_epoch", True, _int(-1), "an integer"),
        ("_step_count", False, _int(), "an integer >= 0"),
        ("base_lrs", False, _list_of(_number), "a list of numbers"),
        ("_last_lr", False, _list_of(_number), "a list of numbers"),
    ],
}

# each optimizer param group's keys: AdamW's, as torch writes them
GROUP = [("lr", True, _number, "a number"), ("params", True, _list_of(_int()), "a list of integers"),
         ("betas", False, _list_of(_number, 2), "a list of 2 numbers"), ("eps", False, _number, "a number"),
         ("weight_decay", False, _number, "a number"), ("initial_lr", False, _number, "a number")]

_ABSENT = object()


def _problems(value: dict, shape: list, prefix: str = "") -> str | None:
    for key, required, check, must in shape:
        parent, _, leaf = key.rpartition(".")
        owner = value
        for part in parent.split(".") if parent else ():
            owner = owner.get(part) if isinstance(owner, dict) else None
        if not isinstance(owner, dict):
            continue  # under a key that is absent (optional) or already reported
        got = owner.get(leaf, _ABSENT)
        if got is _ABSENT:
            if required:
                return f'it has no "{prefix}{key}"'
        elif not check(got):
            return f'"{prefix}{key}" must be {must}, not {repr(got)[:40]}'
    return None


def shape_problem(name: str, value, tensors: set[str]) -> str | None:
    """What is wrong with the types and keys of checkpoint JSON file `name` (parsed: `value`), or None.
    `tensors`: the names optimizer.safetensors holds, which optimizer.json's state refers to."""
    if name not in SHAPES:
        return None
    if not isinstance(value, dict):
        return f"it must be an object ({{...}}), got {type(value).__name__}"
    problem = _problems(value, SHAPES[name])
    if problem or name != "optimizer.json":
        return problem
    for i, group in enumerate(value["param_groups"]):
        problem = _problems(group, GROUP, f"param_groups.{i}.")
        if problem:
            return problem
    for idx, slots in value["state"].items():
        for slot, v in slots.items():
            if isinstance(v, dict) and v.get("tensor") not in tensors:
                return (f'"state.{idx}.{slot}" names tensor {v.get("tensor")!r}, which optimizer.safetensors does '
                        f"not hold")
    return None
