"""Behaviour unchanged by a refactor: the first steps of the default job, run by two checkouts, side by side.

    .venv/bin/python scripts/same_steps.py OUT --before /path/to/old/checkout [--after .] [--steps 3]
                                               [--samplers short vllm_short]

Each checkout runs `grpo train` (the default job, trainer.seed=0, no in-run eval, every completion of every step
written to completions.jsonl) once per sampler: `short` is HF generate, `vllm_short` the in-process vLLM engine,
both cut at 32 tokens as the default job's `auto_short` is. Then, step by step:
  - completions: how many of the step's completions are the same text, and the largest difference in reward and
    advantage between the two checkouts' lines;
  - metrics: every number both runs log (time/, memory/, tokens_per_s and peak_memory_mb left out: they are the
    machine's readings, not the algorithm's) and the largest relative difference among them, with the key it is on.
"Identical" means every completion the same and every compared number equal to the last bit. A run is reused when
its last step is logged, so a stopped comparison goes on where it stopped.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from pathlib import Path

from paired import read_jsonl

# the machine's readings, not the algorithm's numbers (tests.helpers.runs.deterministic leaves the same out)
MACHINE = ("time/", "memory/", "tokens_per_s", "peak_memory_mb")


def train(repo: Path, run: Path, sampler: str, steps: int) -> None:
    if (run / "metrics.jsonl").exists() and any(r["step"] == steps for r in read_jsonl(run / "metrics.jsonl")):
        return
    args = ["train", f"trainer.max_steps={steps}", "trainer.seed=0", "trainer.eval_every=null",
            "trainer.log_completions_every=1", "trainer.num_completions_to_print=0", "trainer.report_to=[]",
            f"sampler={sampler}", f"hydra.run.dir={run}"]
    run.parent.mkdir(parents=True, exist_ok=True)
    with (run.parent / f"{run.name}.log").open("w") as log:
        code = subprocess.call([sys.executable, "-m", "grpo_cli", *args], cwd=repo, stdout=log,
                               stderr=subprocess.STDOUT)
    if code:
        sys.exit(f"grpo train in {repo} failed ({code}): {run.parent / f'{run.name}.log'}")


def compare(before: Path, after: Path, steps: int) -> bool:
    same = True
    a_lines, b_lines = read_jsonl(before / "completions.jsonl"), read_jsonl(after / "completions.jsonl")
    a_rows = {r["step"]: r for r in read_jsonl(before / "metrics.jsonl")}
    b_rows = {r["step"]: r for r in read_jsonl(after / "metrics.jsonl")}
    print("| step | same completions | max reward diff | max advantage diff | numbers compared | "
          "max relative diff (key) |\n|---|---|---|---|---|---|")
    for step in range(1, steps + 1):
        a = [r for r in a_lines if r["step"] == step]
        b = [r for r in b_lines if r["step"] == step]
        texts = sum(x["completion"] == y["completion"] for x, y in zip(a, b))
        reward = max((abs(x["reward"] - y["reward"]) for x, y in zip(a, b)), default=math.nan)
        advantage = max((abs(x["advantage"] - y["advantage"]) for x, y in zip(a, b)), default=math.nan)
        keys = sorted(k for k in set(a_rows[step]) & set(b_rows[step]) if not k.startswith(MACHINE)
                      and isinstance(a_rows[step][k], (int, float)) and isinstance(b_rows[step][k], (int, float)))
        worst, worst_key = 0.0, "-"
        for key in keys:
            x, y = float(a_rows[step][key]), float(b_rows[step][key])
            if x == y or (math.isnan(x) and math.isnan(y)):
                continue
            rel = abs(x - y) / max(abs(x), abs(y))
            if rel > worst:
                worst, worst_key = rel, key
        same &= texts == len(a) == len(b) and reward == 0 and advantage == 0 and worst == 0
        print(f"| {step} | {texts}/{len(a)} (vs {len(b)}) | {reward:.3g} | {advantage:.3g} | {len(keys)} | "
              f"{worst:.3g} ({worst_key}) |")
    only = sorted(set(a_rows[1]) ^ set(b_rows[1]))
    if only:
        print(f"logged by one run only: {', '.join(only)}")
    return same


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--before", type=Path, required=True, help="the checkout before the change")
    ap.add_argument("--after", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--samplers", nargs="+", default=["short", "vllm_short"])
    args = ap.parse_args()
    out = args.out.resolve()
    verdicts = {}
    for sampler in args.samplers:
        for label, repo in (("before", args.before), ("after", args.after)):
            train(repo.resolve(), out / f"{label}_{sampler}", sampler, args.steps)
        print(f"\nsampler={sampler}: {args.before} (before) vs {args.after} (after)")
        verdicts[sampler] = compare(out / f"before_{sampler}", out / f"after_{sampler}", args.steps)
    for sampler, same in verdicts.items():
        print(f"sampler={sampler}: {'identical' if same else 'DIFFERENT'} over {args.steps} steps")


if __name__ == "__main__":
    main()
