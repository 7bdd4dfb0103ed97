"""Dynamic sampling on the default job: held-out accuracy and wall time with and without it (#24).

    .venv/bin/python scripts/dynamic_sampling.py                       # ~30 min quiet on 2 cores, vLLM sampling
    .venv/bin/python scripts/dynamic_sampling.py --steps 2 --limit 20 --out /tmp/ds   # smoke run

Arms: `grpo train sampler=vllm_short` (what `make train` runs; HF generate where vLLM is missing) with
algo.dynamic_sampling false / true (filter_metric accuracy, max_generation_batches 3), same seed: both
arms draw the same first prompts and sampling seeds, so their step-1 completions are the same; the
dynamic arm then trains on other groups. Then `grpo eval` (greedy, the first --limit held-out problems,
the job's 32 new tokens) of both last checkpoints and the base model.

Fixed before running: the endpoint is held-out greedy accuracy; the difference dynamic - off is paired
by problem, with a bootstrap 95% CI over the problems (10,000 resamples). One seed per arm: the CI is the
evaluation's noise, not the training's, so it cannot say whether another seed would differ; with 200
problems the CI half-width is about ±6-8 points. Secondary: training wall time (model load and engine
start included), generation batches per step, the share of tie groups the off arm trained on.

Writes OUT/results.json and prints a table. A finished run is skipped, so a rerun only evaluates.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from process_vs_outcome import finished, grpo, last_checkpoint  # noqa: E402  (this folder is on sys.path)

ARMS = {"off": ["algo.dynamic_sampling=false"],
        "dynamic": ["algo.dynamic_sampling=true", "algo.filter_metric=accuracy", "algo.max_generation_batches=3"]}


def sampler_args() -> list[str]:
    import importlib.util

    return ["sampler=vllm_short"] if importlib.util.find_spec("vllm") else ["sampler=short"]


def greedy(out: Path) -> dict[str | None, dict[int, bool]]:
    """{checkpoint (None: base): {problem index: correct}} from an eval's eval_samples.jsonl."""
    rows = [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()]
    table: dict = {}
    for r in rows:
        table.setdefault(r["checkpoint"], {})[r["index"]] = bool(r["correct"])
    return table


def paired_ci(a: dict[int, bool], b: dict[int, bool], resamples: int = 10_000, seed: int = 0) -> tuple[float, ...]:
    """(mean of b - a, 2.5%, 97.5%) over the problems both have, bootstrapped over problems."""
    keys = sorted(set(a) & set(b))
    d = [int(b[k]) - int(a[k]) for k in keys]
    rng = random.Random(seed)
    means = sorted(sum(rng.choice(d) for _ in d) / len(d) for _ in range(resamples))
    return sum(d) / len(d), means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="training steps (the default job: 40)")
    parser.add_argument("--limit", type=int, default=200, help="held-out problems to evaluate")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "dynamic_sampling")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"steps": args.steps, "limit": args.limit, "sampler": sampler_args(), "arms": {}}
    for arm, extra in ARMS.items():
        run = args.out / "train" / arm
        record: dict = {}
        if not finished(run):
            record["wall_s"] = grpo("train", *sampler_args(), *extra, f"trainer.max_steps={args.steps}",
                                    "trainer.report_to=[]", f"hydra.run.dir={run}", log=args.out / f"train_{arm}.log")
        else:
            record["wall_s"] = json.loads((args.out / "results.json").read_text())["arms"][arm]["wall_s"] \
                if (args.out / "results.json").exists() else None
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
        record.update({
            "train_accuracy_last10": sum(m["rewards/accuracy/mean"] for m in metrics[-10:]) / len(metrics[-10:]),
            "tie_share_trained": sum(m["frac_reward_zero_std"] for m in metrics) / len(metrics),
            "generation_batches": sum(m.get("dynamic/generation_batches", 1) for m in metrics) / len(metrics),
            "batch_full_share": sum(m.get("dynamic/batch_full", 1.0) for m in metrics) / len(metrics),
            "step_s": sum(m["time/step_s"] for m in metrics) / len(metrics),
            "checkpoint": str(last_checkpoint(run))})
        results["arms"][arm] = record
    evaluated = args.out / "eval"
    if not (evaluated / "eval_samples.jsonl").exists():
        grpo("eval", f"checkpoint=[{results['arms']['off']['checkpoint']},{results['arms']['dynamic']['checkpoint']}]",
             "eval.include_base=true", f"eval.limit={args.limit}", "sampler.max_new_tokens=32",
             f"hydra.run.dir={evaluated}", log=args.out / "eval.log")
    table = greedy(evaluated)
    base = next(v for k, v in table.items() if k is None)
    by_arm = {arm: next(v for k, v in table.items() if k and Path(k) == Path(r["checkpoint"]))
              for arm, r in results["arms"].items()}
    results["base_accuracy"] = sum(base.values()) / len(base)
    for arm, correct in by_arm.items():
        results["arms"][arm]["heldout_accuracy"] = sum(correct.values()) / len(correct)
    results["difference"] = dict(zip(("mean", "lo", "hi"), paired_ci(by_arm["off"], by_arm["dynamic"])))
    (args.out / "results.json").write_text(json.dumps(results, indent=1))

    print(f"| arm | held-out greedy accuracy ({args.limit}) | train wall s | s/step | generation batches/step | "
          f"tie groups trained | batch full | train accuracy, last 10 steps |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| base | {results['base_accuracy']:.3f} | – | – | – | – | – | – |")
    for arm, r in results["arms"].items():
        wall = f"{r['wall_s']:.0f}" if r["wall_s"] else "–"
        print(f"| {arm} | {r['heldout_accuracy']:.3f} | {wall} | {r['step_s']:.1f} | {r['generation_batches']:.2f} | "
              f"{r['tie_share_trained']:.2f} | {r['batch_full_share']:.2f} | {r['train_accuracy_last10']:.3f} |")
    d = results["difference"]
    print(f"dynamic - off, paired by problem: {d['mean']:+.3f} (95% CI {d['lo']:+.3f} .. {d['hi']:+.3f})")


if __name__ == "__main__":
    main()
