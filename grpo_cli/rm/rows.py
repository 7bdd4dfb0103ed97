"""Labeled rows: their checks, JSONL read and atomic write, the held-out split by prompt, and the
replay buffer of earlier iterations' rows (the row format and the replay rounding: the package
docstring, grpo_cli/rm/__init__.py).
"""

from __future__ import annotations

import json
import math
import random
from fractions import Fraction
from pathlib import Path
from typing import Any

from grpo_cli import files
from grpo_cli.errors import ConfigError, DataError

Row = dict[str, Any]


# ---- labeled rows ------------------------------------------------------------------------------

def _label_ok(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and 0 <= value <= 1


def row_kind(row: Row, where: str) -> str:
    """`outcome` or `process` for one row, checked; DataError (naming `where` and the fix) if bad."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be a JSON object with prompt, completion and label or steps")
    for key in ("prompt", "completion"):
        if not isinstance(row.get(key), str):
            raise DataError(f"{where}: {key!r} is missing or not a string; every row needs \"prompt\" and "
                            f"\"completion\" text")
    has_label, has_steps = row.get("label") is not None, row.get("steps") is not None
    if has_label and has_steps:
        raise DataError(f"{where}: both \"label\" and \"steps\"; a row is an outcome row (label) or a process "
                        f"row (steps): drop one of them")
    if not has_label and not has_steps:
        raise DataError(f"{where}: no label; an outcome row needs \"label\" (0..1), a process row \"steps\" "
                        f"([[char_end, label], ...]): add it or drop the line")
    if has_label:
        if not _label_ok(row["label"]):
            raise DataError(f"{where}: label {row['label']!r} must be a number in [0, 1]; fix or drop the line")
        return "outcome"
    steps, n = row["steps"], len(row["completion"])
    if not isinstance(steps, list) or not steps:
        raise DataError(f"{where}: \"steps\" must be a non-empty list of [char_end, label] pairs; "
                        f"fix or drop the line")
    last = 0
    for step in steps:
        if not (isinstance(step, (list, tuple)) and len(step) == 2 and isinstance(step[0], int)
                and not isinstance(step[0], bool)):
            raise DataError(f"{where}: step {step!r} must be a pair [char_end, label] with an integer char_end")
        end, label = step
        if not 0 < end <= n:
            raise DataError(f"{where}: step end {end} is outside the completion ({n} characters); a step end is "
                            f"the exclusive character offset of the step's end, in 1..{n}")
        if end <= last:
            raise DataError(f"{where}: step ends must increase ({last} then {end}); sort the steps by char_end")
        if not _label_ok(label):
            raise DataError(f"{where}: step label {label!r} must be a number in [0, 1]; fix or drop the line")
        last = end
    return "process"


def check_rows(rows: list[Row], source: str = "rows") -> str:
    """The kind shared by every row; DataError at the first bad row (1-based, as a file line)."""
    if not rows:
        raise DataError(f"{source} holds no labeled rows; label some samples first")
    kind = None
    for i, row in enumerate(rows, 1):
        this = row_kind(row, f"{source} line {i}")
        if kind is None:
            kind = this
        elif this != kind:
            raise DataError(f"{source} line {i} is a {this} row but line 1 is a {kind} row; one reward model "
                            f"trains on one kind: split the file")
    return kind


def read_labeled(path: str | Path) -> tuple[list[Row], str]:
    """(rows, kind) of a labeled JSONL; DataError naming the file and line on a bad row."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"rm.labeled={path} is not a file; pass a JSONL of labeled rows "
                          f"(their format: grpo_cli/rm/)")
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise DataError(f"{path} line {i} is not JSON ({err.msg}); fix or drop the line") from None
    return rows, check_rows(rows, str(path))


def write_jsonl(path: str | Path, rows: list[Row]) -> None:
    """Write rows atomically (a temporary file renamed into place)."""
    files.write_text(path, "".join(json.dumps(row) + "\n" for row in rows))


def split_heldout(rows: list[Row], fraction: float, seed: int) -> tuple[list[Row], list[Row]]:
    """(train, held-out) rows, split by prompt so no held-out problem is trained on.

    round(fraction * P) of the P distinct prompts (halves up) are held out, seeded; at least one
    when fraction > 0 and at most P - 1, so neither side is empty when P >= 2.
    """
    prompts = list(dict.fromkeys(r["prompt"] for r in rows))
    count = math.floor(Fraction(str(fraction)) * len(prompts) + Fraction(1, 2))
    if fraction > 0:
        count = min(max(count, 1), len(prompts) - 1)
    held = set(random.Random(seed).sample(prompts, count)) if count > 0 else set()
    return [r for r in rows if r["prompt"] not in held], [r for r in rows if r["prompt"] in held]


# ---- replay ------------------------------------------------------------------------------------

def replay_count(n_new: int, share: float) -> int:
    """Earlier rows to add to n_new new ones: round(n_new * share / (1 - share)), halves up.

    Exact (the share is read as the decimal it is written as), so 0.1 of a 90-row mix is 10, not 9.
    """
    s = Fraction(str(share))
    if s >= 1:
        raise ValueError("share 1 has no finite count: the mix is all earlier rows")
    return math.floor(Fraction(n_new) * s / (1 - s) + Fraction(1, 2))


def check_share(share: Any, key: str = "rm.replay.share") -> float:
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
        raise ConfigError(f"{key} ({share!r}) must be in [0, 1]: the share of earlier iterations' rows in each "
                          f"reward-model training mix; set {key}=0.1")
    return float(share)


class ReplayBuffer:
    """Labeled rows of each iteration in `folder/iteration_NNN.jsonl`, and the replay mix.

    The files are the state: `mix(i, new)` reads only iterations < i and is a pure function of
    (seed, i, those files), so a resumed run draws the same mix; `add(i, rows)` rewrites iteration
    i's file. `state_dict()` records the settings and the row count of each iteration for a
    checkpoint; `load_state_dict` checks the folder still holds exactly those rows.
    """

    PATTERN = "iteration_{:03d}.jsonl"

    def __init__(self, folder: str | Path, share: float = 0.1, seed: int = 0):
        self.folder = Path(folder)
        self.share = check_share(share)
        self.seed = seed

    def path(self, iteration: int) -> Path:
        return self.folder / self.PATTERN.format(iteration)

    def iterations(self) -> list[int]:
        if not self.folder.is_dir():
            return []
        found = [p.name[len("iteration_"):-len(".jsonl")] for p in self.folder.glob("iteration_*.jsonl")]
        return sorted(int(i) for i in found if i.isdigit())

    def next_iteration(self) -> int:
        done = self.iterations()
        return done[-1] + 1 if done else 0

    def rows(self, iteration: int) -> list[Row]:
        path = self.path(iteration)
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def add(self, iteration: int, rows: list[Row]) -> None:
        """Store iteration `iteration`'s new rows (replacing any earlier file of that iteration)."""
        write_jsonl(self.path(iteration), [{**r, "iteration": iteration} for r in rows])

    def mix(self, iteration: int, new: list[Row]) -> tuple[list[Row], dict]:
        """(new rows + replayed rows of iterations < `iteration`, counts). Replayed rows keep their
        `iteration` field, so a caller can see where each came from."""
        earlier = [r for i in self.iterations() if i < iteration for r in self.rows(i)]
        if self.share >= 1:
            mixed, want = list(earlier), len(earlier)
            new = []
        else:
            want = replay_count(len(new), self.share)
            rng = random.Random(self.seed * 1_000_003 + iteration)
            mixed = rng.sample(earlier, min(want, len(earlier)))
        replayed = len(mixed)
        mixed = list(new) + mixed
        if mixed:
            check_rows(mixed, f"replay mix of iteration {iteration}")
        info = {"iteration": iteration, "new": len(new), "replay": replayed, "replay_wanted": want,
                "earlier_available": len(earlier), "share": replayed / len(mixed) if mixed else 0.0}
        return mixed, info

    def state_dict(self) -> dict:
        return {"folder": str(self.folder), "share": self.share, "seed": self.seed,
                "rows": {str(i): len(self.rows(i)) for i in self.iterations()}}

    def load_state_dict(self, state: dict) -> None:
        self.share, self.seed = check_share(state["share"]), int(state["seed"])
        for i, count in state["rows"].items():
            have = len(self.rows(int(i)))
            if have != count:
                raise ConfigError(f"replay buffer {self.folder}: iteration {i} holds {have} rows but the checkpoint "
                                  f"recorded {count}; restore {self.path(int(i)).name} or start a new run")
