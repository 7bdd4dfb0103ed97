"""Iterative RL vs a fixed reward model, paired per seed (issue #28).

    .venv/bin/python scripts/iterative_vs_fixed.py                                  # 3 seeds x {iterative, fixed}
    .venv/bin/python scripts/iterative_vs_fixed.py --seeds 0 --iterations 2 --steps 1 --problems 4 --limit 8 \\
        --rm-problems 4 --out /tmp/ivf                                              # smoke run

The claim, endpoint and analysis, fixed before any run:
- the starting reward model: one `grpo rm sampler.temperature=0.5` (docs/reward-models.md: AUC 0.88), OUT/rm;
- arms: `+recipe=iterative_from_rm reward.name_or_path=OUT/rm/model` with iterative.retrain=true (iterative: the
  reward model is retrained on the current policy's samples at every boundary) or false (fixed: iteration 0's model
  scores every iteration; later boundaries only measure it); equal in all else, same seed -> same prompts;
- primary endpoint: held-out greedy accuracy by the rule (`grpo eval`, the first --limit held-out problems) of each
  run's last checkpoint; per seed the paired difference iterative - fixed, its mean over seeds with a two-level
  bootstrap 95% CI (seeds, then problems); the base model (adapter off) alongside;
- the paper's reason for iterating, measured: at each boundary the AUC of the reward model then scoring on fresh
  samples of the current policy, labeled by the rule, before and after retraining (iterations.jsonl); it should fall
  as the policy moves and rise again when the model is retrained;
- secondary: completion length and truncated share per step (metrics.jsonl), the gate's decisions.
- "iterating pays" means: the CI's lower bound > 0, and the iterative arm above the base model in every seed.
- size, estimated before any run from docs/iterative-rl.md's timings (~15 s a GRPO step quiet, ~60 s a boundary of
  24 problems x 4 samples): grpo rm ~5 min, 6 runs x 3 iterations x 5 steps ~7 min each, eval ~4 min: ~51 min;
  the design's detectable difference (2.8 x the bootstrap SE) is reported with the result.

Runs: OUT/train/ARM_sS (finished runs are skipped, interrupted ones resumed). Writes OUT/results.json,
OUT/table.md and the plot (--plot). Sizes (--iterations, --steps, --problems) default to what fits an hour.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from paired import REPO, bootstrap, grpo, last_checkpoint, read_jsonl, save_figure

ARMS = ("iterative", "fixed")


def reward_model(out: Path, extra: list[str]) -> tuple[Path, float | None]:
    """The starting reward model (trained once, docs/reward-models.md's AUC 0.88 setting): OUT/rm/model."""
    folder = out / "rm"
    if not (folder / "model").exists():
        print(f"grpo rm -> {folder}", flush=True)
        wall = grpo("rm", "sampler.temperature=0.5", f"hydra.run.dir={folder}", *extra, log=out / "logs" / "rm.log")
        (folder / "wall_s.json").write_text(json.dumps({"wall_s": wall}))
    timing = folder / "wall_s.json"
    return folder / "model", json.loads(timing.read_text())["wall_s"] if timing.exists() else None


def train(arm: str, seed: int, args, model: Path, out: Path) -> dict:
    run = out / "train" / f"{arm}_s{seed}"
    steps = args.iterations * args.steps
    timing = run / "wall_s.json"
    ckpt = last_checkpoint(run)
    if ckpt is None or int(ckpt.name[5:]) < steps:
        print(f"train {arm} seed {seed} -> {run}", flush=True)
        how = [f"resume={run}"] if ckpt else [
            # HF generate, as measured (sampler=auto would pick vLLM where it is installed)
            "+recipe=iterative_from_rm", "sampler=short", f"reward.name_or_path={model}",
            f"iterative.retrain={arm == 'iterative'}",
            f"iterative.iterations={args.iterations}", f"iterative.steps={args.steps}", f"trainer.max_steps={steps}",
            f"rm.num_problems={args.problems}", f"trainer.seed={seed}", "trainer.report_to=[]",
            f"hydra.run.dir={run}", *args.overrides]
        wall = grpo("train", *how, log=out / "logs" / f"train_{arm}_s{seed}.log")
        timing.write_text(json.dumps({"wall_s": wall}))
    wall = json.loads(timing.read_text())["wall_s"] if timing.exists() else None
    return {"arm": arm, "seed": seed, "run": str(run), "wall_s": wall, "checkpoint": str(last_checkpoint(run))}


def summarize(runs: list[dict], eval_rows: list[dict], limit: int, draws: int) -> dict:
    by_checkpoint: dict[str | None, dict[int, float]] = {}
    for row in eval_rows:
        if row["index"] < limit:
            by_checkpoint.setdefault(row["checkpoint"], {})[row["index"]] = float(row["correct"])
    base = by_checkpoint[None]
    seeds = sorted({r["seed"] for r in runs})
    per_seed, diffs = [], {}
    for seed in seeds:
        arm = {r["arm"]: r for r in runs if r["seed"] == seed}
        acc = {a: by_checkpoint[arm[a]["checkpoint"]] for a in ARMS}
        diffs[seed] = [acc["iterative"][i] - acc["fixed"][i] for i in sorted(base)]
        row = {"seed": seed, "d": statistics.mean(diffs[seed])}
        for a in ARMS:
            run = Path(arm[a]["run"])
            history = read_jsonl(run / "iterations.jsonl")
            metrics = read_jsonl(run / "metrics.jsonl")
            row[a] = {"accuracy": statistics.mean(acc[a].values()), "wall_s": arm[a]["wall_s"],
                      "auc_before": [h.get("rm/auc_current_policy_before") for h in history],
                      "auc_after": [h.get("rm/auc_current_policy_after") for h in history],
                      "kept_previous": [h.get("kept_previous") for h in history],
                      "length": [m["completions/mean_length"] for m in metrics],
                      "truncated": [m["completions/clipped_ratio"] for m in metrics]}
        per_seed.append(row)
    low, high, se = bootstrap(diffs, draws)
    base_acc = statistics.mean(base.values())
    above = all(row["iterative"]["accuracy"] > base_acc for row in per_seed)
    return {"base": base_acc, "d": statistics.mean(row["d"] for row in per_seed), "ci": [low, high], "se": se,
            "detectable": 2.8 * se,
            "iterative_above_base_every_seed": above, "iterating_pays": low > 0 and above, "per_seed": per_seed}


def table(s: dict) -> str:
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    # the boundaries' AUCs are within-prompt since issue #44 (the runs of issue #28 logged the pooled AUC)
    rows = ["| seed | iterative acc | fixed acc | d (iterative - fixed) | within-prompt AUC on current policy, "
            "iterative (before → after) | within-prompt AUC, fixed | train wall (i / f) |",
            "|---|---|---|---|---|---|---|"]
    for row in s["per_seed"]:
        i, f = row["iterative"], row["fixed"]
        rows.append(f"| {row['seed']} | {i['accuracy']:.3f} | {f['accuracy']:.3f} | {row['d']:+.3f} | "
                    + ", ".join(f"{fmt(b)}→{fmt(a)}" for b, a in zip(i["auc_before"], i["auc_after"])) + " | "
                    + ", ".join(fmt(b) for b in f["auc_before"]) + f" | {i['wall_s'] or 0:.0f} s / "
                    f"{f['wall_s'] or 0:.0f} s |")
    return "\n".join(rows) + (
        f"\n\nBase model {s['base']:.3f}. Mean paired difference {s['d']:+.3f} (95% CI {s['ci'][0]:+.3f} … "
        f"{s['ci'][1]:+.3f}; detectable ≈ {s['detectable']:.3f}); iterative above base in every seed: "
        f"{s['iterative_above_base_every_seed']}; "
        f"iterating pays by the rule fixed in advance: **{'yes' if s['iterating_pays'] else 'no'}**.\n")


def plot(s: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for arm, color in zip(ARMS, ("tab:orange", "tab:blue")):
        for n, row in enumerate(s["per_seed"]):
            label = arm if n == 0 else None
            auc = [v if v is not None else float("nan") for v in row[arm]["auc_before"]]
            axes[0].plot(range(len(auc)), auc, "o-", color=color, alpha=0.7, label=label)
            axes[1].plot(range(1, len(row[arm]["length"]) + 1), row[arm]["length"], color=color, alpha=0.7,
                         label=label)
            axes[2].plot(range(1, len(row[arm]["truncated"]) + 1), row[arm]["truncated"], color=color, alpha=0.7,
                         label=label)
    titles = ("reward model's within-prompt AUC on the current policy's samples\n(at each boundary, before "
              "retraining)",
              "completion length (tokens)", "truncated share")
    for ax, title, x in zip(axes, titles, ("iteration", "step", "step")):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(x)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"iterative vs fixed reward model · held-out accuracy d = {s['d']:+.3f} "
                 f"(95% CI {s['ci'][0]:+.3f} … {s['ci'][1]:+.3f}), base {s['base']:.3f}", fontsize=10)
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0,1,2", help="training seeds (trainer.seed), comma-separated")
    parser.add_argument("--iterations", type=int, default=3, help="iterative.iterations")
    parser.add_argument("--steps", type=int, default=5, help="iterative.steps (GRPO steps per iteration)")
    parser.add_argument("--problems", type=int, default=24, help="rm.num_problems per boundary")
    parser.add_argument("--rm-problems", type=int, default=None,
                        help="rm.num_problems of the starting grpo rm (default: conf/rm's 64, the measured setting)")
    parser.add_argument("--limit", type=int, default=100, help="held-out problems to evaluate")
    parser.add_argument("--boot", type=int, default=10_000, help="bootstrap draws")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "iterative_vs_fixed")
    parser.add_argument("--plot", type=Path, default=REPO / "docs" / "iterative_vs_fixed.png")
    parser.add_argument("overrides", nargs="*", help="more overrides for both arms' training (key=value)")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    out = args.out.resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    model, rm_wall = reward_model(out, [f"rm.num_problems={args.rm_problems}"] if args.rm_problems else [])
    runs = [train(arm, seed, args, model, out) for seed in seeds for arm in ARMS]
    eval_dir = out / "eval"
    if not (eval_dir / "eval_samples.jsonl").exists():
        print(f"eval: base + {len(runs)} checkpoints on {args.limit} held-out problems", flush=True)
        grpo("eval", "checkpoint=[" + ",".join(r["checkpoint"] for r in runs) + "]", "eval.include_base=true",
             f"eval.limit={args.limit}", f"hydra.run.dir={eval_dir}", log=out / "logs" / "eval.log")
    summary = summarize(runs, read_jsonl(eval_dir / "eval_samples.jsonl"), args.limit, args.boot)
    results = {"runs": runs, "seeds": seeds, "rm_wall_s": rm_wall, "summary": summary, "args": {
        k: v for k, v in vars(args).items() if k not in ("out", "plot")},
        "script_wall_s": time.perf_counter() - started}
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    text = table(summary)
    (out / "table.md").write_text(text)
    plot(summary, args.plot)
    print(text)
    print(f"this invocation {results['script_wall_s']:.0f} s; {out / 'results.json'}; plot {args.plot}")


if __name__ == "__main__":
    main()
