"""Process vs outcome supervision on multi-step arithmetic, measured: train both recipes over seeds, evaluate.

    .venv/bin/python scripts/process_vs_outcome.py                      # 2 recipes x seeds 0,1,2, then eval
    .venv/bin/python scripts/process_vs_outcome.py --seeds 0 --steps 2 --limit 20 --out /tmp/pvo   # smoke run

1. `grpo train +recipe=multistep_{outcome,process} trainer.seed=S` for each seed, one after the other, each in
   OUT/train/ARM_sS (a finished run is skipped and an interrupted one resumed, so a rerun continues where it
   stopped);
2. one `grpo eval` over the base model and every run's last checkpoint (greedy, the first --limit held-out
   problems; OUT/eval/eval_samples.jsonl keeps every completion, and a rerun skips what is there);
3. from those completions: per run, held-out accuracy and the step statistics the rule-based verifier gives;
   per recipe, mean ± sample std over seeds. Writes OUT/results.json, OUT/table.md and the plot (--plot) of the
   training curves (training-sample accuracy and completion length, per recipe: mean over seeds, min-max band).

Wall times are the training subprocesses' (model load included); the eval's is reported apart.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from grpo_cli.rewards.steps import chain_steps, check_claims, split_steps  # noqa: E402

ARMS = ("outcome", "process")


def grpo(*args: str, log: Path) -> float:
    """Run `grpo ARGS` (this interpreter's grpo_cli), output to `log`; returns its wall time in seconds."""
    start = time.perf_counter()
    with log.open("w") as out:
        done = subprocess.run([sys.executable, "-m", "grpo_cli", *args], cwd=REPO, stdout=out,
                              stderr=subprocess.STDOUT)
    if done.returncode:
        sys.exit(f"grpo {' '.join(args)} failed (exit {done.returncode}); see {log}")
    return time.perf_counter() - start


def last_checkpoint(run: Path) -> Path | None:
    found = sorted((run / "checkpoints").glob("step_*"))
    return found[-1] if found else None


def finished(run: Path) -> bool:
    """Has the run reached its own trainer.max_steps?"""
    ckpt, config = last_checkpoint(run), run / ".hydra" / "config.yaml"
    if ckpt is None or not config.exists():
        return False
    from omegaconf import OmegaConf

    return int(ckpt.name[5:]) >= OmegaConf.load(config).trainer.max_steps


def step_stats(text: str, reference_solution: str) -> dict:
    """Lines of one completion: how many, how many make a claim, how many are correct steps (the process
    reward's chain judge: the reference's next step), how many have true arithmetic (any numbers), how many
    are reference steps in any order."""
    lines = [text[a:b] for a, b in split_steps(text)]
    claims = [check_claims(line) for line in lines]
    reference = {" ".join(line.split()) for line in reference_solution.split("\n")}
    return {"lines": len(lines), "checkable": sum(bool(c) for c in claims),
            "correct": sum(r == 1.0 for _, r in chain_steps(text, reference_solution)),
            "true_arithmetic": sum(bool(c) and all(c) for c in claims),
            "on_chain": len(reference & {" ".join(line.split()) for line in lines}),
            "reference_steps": len(reference)}


def summarize_run(rows: list[dict], solutions: dict[str, str]) -> dict:
    stats = [step_stats(r["greedy"]["text"], solutions[r["question"]]) for r in rows]
    total = lambda key: sum(s[key] for s in stats)  # noqa: E731
    return {"accuracy": sum(r["correct"] for r in rows) / len(rows),
            "correct_steps": total("correct") / max(total("lines"), 1),
            "true_arithmetic": total("true_arithmetic") / max(total("lines"), 1),
            "checkable_steps": total("checkable") / max(total("lines"), 1),
            "lines_per_solution": total("lines") / len(rows),
            "reference_steps_written": total("on_chain") / total("reference_steps"),
            "truncated": sum(r["greedy"]["truncated"] for r in rows) / len(rows),
            "problems": len(rows)}


def training_record(run: Path) -> dict:
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"steps": [m["step"] for m in metrics],
            "accuracy": [m["rewards/accuracy/mean"] for m in metrics],
            "length": [m["completions/mean_length"] for m in metrics],
            "zero_std": [m["frac_reward_zero_std"] for m in metrics],
            "rollout_s": sum(m["time/rollout_s"] for m in metrics),
            "update_s": sum(m["time/update_s"] for m in metrics),
            "backward_seqs": sum(m.get("counts/backward_seqs", 0) for m in metrics)}


def mean_sd(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {sd:.3f}"


def table(results: dict) -> str:
    base = results["base"]
    rows = ["| model | held-out greedy accuracy | correct steps | lines with true arithmetic | "
            "reference steps written | lines per solution | train wall time per run |",
            "|---|---|---|---|---|---|---|",
            f"| base (adapter off) | {base['accuracy']:.3f} | {base['correct_steps']:.3f} | "
            f"{base['true_arithmetic']:.3f} | {base['reference_steps_written']:.3f} | "
            f"{base['lines_per_solution']:.2f} | – |"]
    for arm in ARMS:
        runs = [r for r in results["runs"] if r["arm"] == arm]
        if not runs:
            continue
        def col(key: str, runs: list[dict] = runs) -> list[float]:
            return [r["eval"][key] for r in runs]

        per_seed = ", ".join(f"{a:.3f}" for a in col("accuracy"))
        wall = statistics.mean(r["wall_s"] for r in runs if r["wall_s"] is not None) if any(
            r["wall_s"] is not None for r in runs) else float("nan")
        rows.append(f"| {arm} ({len(runs)} seeds, step {runs[0]['step']}) | {mean_sd(col('accuracy'))} ({per_seed}) | "
                    f"{mean_sd(col('correct_steps'))} | {mean_sd(col('true_arithmetic'))} | "
                    f"{mean_sd(col('reference_steps_written'))} | {statistics.mean(col('lines_per_solution')):.2f} | "
                    f"{wall:.0f} s |")
    return "\n".join(rows) + "\n"


def smooth(values: list[float], window: int) -> list[float]:
    return [statistics.mean(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]


def plot(results: dict, path: Path, window: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    panels = (("accuracy", f"training-sample accuracy ({window}-step mean)"),
              ("length", "completion length (tokens)"))
    for ax, (key, title) in zip(axes, panels):
        for arm, color in zip(ARMS, ("tab:blue", "tab:orange")):
            curves = [smooth(r["train"][key], window) for r in results["runs"] if r["arm"] == arm]
            if not curves:
                continue
            n = min(map(len, curves))
            steps = list(range(1, n + 1))
            columns = list(zip(*(c[:n] for c in curves)))
            ax.plot(steps, [statistics.mean(c) for c in columns], color=color,
                    label=f"{arm} (mean of {len(curves)} seeds)")
            ax.fill_between(steps, [min(c) for c in columns], [max(c) for c in columns], color=color, alpha=0.2)
        ax.set_title(title)
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
    axes[0].legend()
    base = results["base"]["accuracy"]
    finals = {arm: [r["eval"]["accuracy"] for r in results["runs"] if r["arm"] == arm] for arm in ARMS}
    fig.suptitle("multistep: outcome vs process supervision · held-out greedy accuracy: base "
                 f"{base:.3f}, " + ", ".join(f"{a} {statistics.mean(v):.3f}" for a, v in finals.items() if v),
                 fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0,1,2", help="training seeds (trainer.seed), comma-separated")
    parser.add_argument("--steps", type=int, default=None, help="trainer.max_steps (default: the recipes')")
    parser.add_argument("--limit", type=int, default=100, help="held-out problems to evaluate")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "process_vs_outcome")
    parser.add_argument("--plot", type=Path, default=REPO / "docs" / "process_vs_outcome.png")
    parser.add_argument("--window", type=int, default=5, help="moving-average window of the training curves")
    parser.add_argument("overrides", nargs="*", help="more overrides for both recipes (key=value)")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    out = args.out.resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    extra = list(args.overrides) + ([f"trainer.max_steps={args.steps}"] if args.steps else [])
    started = time.perf_counter()

    runs = []
    for seed in seeds:
        for arm in ARMS:
            run = out / "train" / f"{arm}_s{seed}"
            timing = run / "wall_s.json"
            if not finished(run):
                # an interrupted run continues from its last checkpoint; its wall time then misses the lost steps
                resume = last_checkpoint(run) is not None
                print(f"train {arm} seed {seed} -> {run}" + (" (resumed)" if resume else ""), flush=True)
                how = [f"resume={run}"] if resume else [f"+recipe=multistep_{arm}", f"trainer.seed={seed}",
                                                        f"hydra.run.dir={run}", *extra]
                wall = grpo("train", *how, log=out / "logs" / f"train_{arm}_s{seed}.log")
                timing.write_text(json.dumps({"wall_s": wall, "resumed": resume}))
            wall = json.loads(timing.read_text())["wall_s"] if timing.exists() else None
            runs.append({"arm": arm, "seed": seed, "run": str(run), "wall_s": wall,
                         "checkpoint": str(last_checkpoint(run)), "step": int(last_checkpoint(run).name[5:])})

    print(f"eval: base + {len(runs)} checkpoints on {args.limit} held-out problems", flush=True)
    eval_dir = out / "eval"
    checkpoints = "[" + ",".join(r["checkpoint"] for r in runs) + "]"
    eval_wall = grpo("eval", f"checkpoint={checkpoints}", "eval.include_base=true", f"eval.limit={args.limit}",
                     f"hydra.run.dir={eval_dir}", log=out / "logs" / "eval.log")

    from grpo_cli.data import load_task

    solutions = {e["question"]: e["solution"] for e in load_task("multistep").heldout}
    rows = [json.loads(line) for line in (eval_dir / "eval_samples.jsonl").read_text().splitlines() if line.strip()]
    by_checkpoint: dict[str | None, list[dict]] = {}
    for row in rows:
        if row["index"] < args.limit:
            by_checkpoint.setdefault(row["checkpoint"], []).append(row)
    for r in runs:
        r["eval"] = summarize_run(by_checkpoint[r["checkpoint"]], solutions)
        r["train"] = training_record(Path(r["run"]))
    results = {"base": summarize_run(by_checkpoint[None], solutions), "runs": runs, "eval_wall_s": eval_wall,
               "total_wall_s": time.perf_counter() - started, "limit": args.limit, "seeds": seeds,
               "overrides": extra}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    text = table(results)
    (out / "table.md").write_text(text)
    plot(results, args.plot, args.window)
    print(text)
    for r in runs:
        t = r["train"]
        print(f"{r['arm']} seed {r['seed']}: accuracy {r['eval']['accuracy']:.3f}, wall {r['wall_s'] or 0:.0f} s "
              f"(rollout {t['rollout_s']:.0f} s, update {t['update_s']:.0f} s, {t['backward_seqs']} backward seqs)")
    print(f"eval {eval_wall:.0f} s; total {results['total_wall_s']:.0f} s; {out / 'results.json'}; plot {args.plot}")


if __name__ == "__main__":
    main()
