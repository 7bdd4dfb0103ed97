"""The guard's length tripwire replayed on finished runs: where it fires, and how far each run came from firing.

    .venv/bin/python scripts/tripwire_replay.py [--max-ratio 1.5] [--out FILE.md]

Reads the per-step records kept in git by the experiments (no weights, no run folders):
- experiments/async/results/k{0,1}_seed*.json: the default job, 40 steps (`metrics`);
- experiments/credit_sparse/results/{O,P}_s*.json: the base model on add3, 24 steps (`curve`: length, truncated);
- experiments/credit/results/{O,Oplus,P}_s*.json: the warm start on add3, 24 steps (`curve`: length only, so the
  truncated-share half of the tripwire is not replayed there).

Each run's steps go through `grpo_cli.guard.length` one at a time, as the guard reads them, with the thresholds of
conf/train.yaml (trainer.guard.length; --max-ratio replays another length ratio, e.g. 1.5, the default before it was
turned off); the guard's other tripwires and its rewinds are not replayed (a replay of
a run that trained on is what the run would have seen up to its first firing). Per run: the steps it fires at, the
largest ratio of a step's mean length to its running mean, and the largest rise of the truncated share over its
running mean, and its last held-out accuracy; then the same by job and arm.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from omegaconf import OmegaConf
from paired import REPO

from grpo_cli import guard

SOURCES = (("default job", "async/results", "k*_seed*.json"),
           ("add3 from the base model", "credit_sparse/results", "[OP]_s*.json"),
           ("add3 from a warm start", "credit/results", "*_s*.json"))


def thresholds() -> dict:
    """trainer.guard.length as conf/train.yaml declares it (its remedy aside)."""
    node = OmegaConf.load(REPO / "conf" / "train.yaml").trainer.guard.length
    return {k: node[k] for k in ("max_ratio", "max_truncated_rise", "window")}


def records(result: dict) -> list[dict] | None:
    """A result's step records with mean length and truncated share (None where the result has no per-step
    lengths). A curve without truncated shares gives None for them."""
    if "metrics" in result:
        return [{"step": r["step"], "completions/mean_length": r["completions/mean_length"],
                 "completions/clipped_ratio": r["completions/clipped_ratio"]}
                for r in result["metrics"] if "completions/mean_length" in r]
    curve = result.get("curve") or {}
    if "length" not in curve:
        return None
    truncated = curve.get("truncated") or [None] * len(curve["length"])
    return [{"step": i + 1, "completions/mean_length": n, "completions/clipped_ratio": t}
            for i, (n, t) in enumerate(zip(curve["length"], truncated))]


def replay(rows: list[dict], max_ratio: float | None, max_truncated_rise: float | None, window: int) -> dict:
    """The steps the length tripwire fires at, read step by step; the largest length ratio and truncated rise
    (None without truncated shares)."""
    has_truncated = all(r["completions/clipped_ratio"] is not None for r in rows)
    filled = [r if has_truncated else {**r, "completions/clipped_ratio": 0.0} for r in rows]
    fired, ratio, rise = [], 0.0, 0.0 if has_truncated else None
    for n in range(window + 1, len(filled) + 1):
        history = filled[:n]
        trip = guard.length(history, max_ratio, max_truncated_rise if has_truncated else None, window)
        if trip is not None:
            fired.append(trip.step)
        # a ratio of 0 fires on any step: its values are the step's numbers and their running means
        v = guard.length(history, 0.0, None, window).values
        ratio = max(ratio, v["mean_length"] / v["baseline_length"])
        if has_truncated:
            rise = max(rise, v["truncated"] - v["baseline_truncated"])
    return {"fired": fired, "max_ratio": ratio, "max_truncated_rise": rise}


def final_accuracy(result: dict) -> float | None:
    """The run's last held-out accuracy: the experiment's eval of its last checkpoint, or its last in-run eval."""
    if "accuracy" in result:
        return result["accuracy"]
    evals = [r["eval/accuracy"] for r in result.get("metrics", []) if "eval/accuracy" in r]
    return evals[-1] if evals else None


def replays(experiments: Path, limits: dict) -> list[dict]:
    """Every kept run with per-step lengths: its job, name, arm, steps, last held-out accuracy and replay."""
    found = []
    for job, folder, pattern in SOURCES:
        for path in sorted((experiments / folder).glob(pattern)):
            result = json.loads(path.read_text())
            rows = records(result)
            if rows:
                found.append({"job": job, "run": path.stem, "arm": path.stem.rsplit("_", 1)[0], "steps": len(rows),
                              "accuracy": final_accuracy(result), **replay(rows, **limits)})
    return found


def _rise(value: float | None) -> str:
    return "–" if value is None else f"{value:+.2f}"


def table(found: list[dict], limits: dict) -> list[str]:
    """A row per run."""
    lines = [f"thresholds: max_ratio {limits['max_ratio']}, max_truncated_rise {limits['max_truncated_rise']}, "
             f"window {limits['window']}", "",
             "| job | run | steps | last held-out accuracy | fires at steps | largest length ratio "
             "| largest truncated rise |", "|---|---|---|---|---|---|---|"]
    for r in found:
        accuracy = "–" if r["accuracy"] is None else f"{r['accuracy']:.3f}"
        fired = ", ".join(map(str, r["fired"])) or "none"
        lines.append(f"| {r['job']} | {r['run']} | {r['steps']} | {accuracy} | {fired} | {r['max_ratio']:.2f} | "
                     f"{_rise(r['max_truncated_rise'])} |")
    return lines


def summary(found: list[dict]) -> list[str]:
    """A row per job and arm: runs, runs fired, the largest length ratio and truncated rise among them."""
    lines = ["| job | arm | runs | runs it fires on | largest length ratio | largest truncated rise |",
             "|---|---|---|---|---|---|"]
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in found:
        groups.setdefault((r["job"], r["arm"]), []).append(r)
    for (job, arm), runs in groups.items():
        rises = [r["max_truncated_rise"] for r in runs if r["max_truncated_rise"] is not None]
        lines.append(f"| {job} | {arm} | {len(runs)} | {sum(bool(r['fired']) for r in runs)} | "
                     f"{max(r['max_ratio'] for r in runs):.2f} | {_rise(max(rises) if rises else None)} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--experiments", type=Path, default=REPO / "experiments")
    parser.add_argument("--max-ratio", type=float, default=None, help="replay this max_ratio, not conf/train.yaml's")
    parser.add_argument("--out", type=Path, default=None, help="also write the tables here (markdown)")
    args = parser.parse_args()
    limits = thresholds()
    if args.max_ratio is not None:
        limits["max_ratio"] = args.max_ratio
    found = replays(args.experiments, limits)
    text = "\n".join([*table(found, limits), "", *summary(found)]) + "\n"
    print(text, end="")
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
