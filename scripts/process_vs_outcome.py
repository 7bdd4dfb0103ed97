"""Process vs outcome supervision on multi-step arithmetic, paired on the training stream (issue #27).

    .venv/bin/python scripts/process_vs_outcome.py                         # 6 seeds x {outcome, process}
    .venv/bin/python scripts/process_vs_outcome.py --seeds 0 --steps 2 --out /tmp/pvo   # smoke run

The claim, endpoint and analysis, fixed before any run:
- arms: `+recipe=multistep_outcome` and `+recipe=multistep_process` (A = A_outcome + 1·A_process); they differ in
  the reward alone. Each seed runs both arms on the same prompt stream with the same per-step sampling seeds, so
  their step-1 completions are identical (asserted) and every later prompt is shared: the arms are paired.
- primary endpoint: sampled accuracy (the rule's `accuracy`, a truncated completion wrong) of the G completions of
  each fresh prompt of the last --window training steps, paired by (seed, step, prompt): d = process - outcome.
  Per seed, the mean d over its prompts; overall, the mean of the per-seed means, with a two-level bootstrap 95% CI
  (seeds resampled, then prompts within each seed; --boot draws).
- "process beats outcome" means: the CI's lower bound > 0, d > 0 in all seeds but one (4 of 5, 5 of 6), and the
  process arm's truncation share in the window at most the outcome arm's + 5 points.
- size (from the seed-0 timing, before the runs): 6 seeds x 16 steps, the endpoint on steps 9-16 (32 prompts x G=8
  completions per seed and arm), ~50 min; the learning rate from a 2-value probe on the outcome arm (the recipes).
- detectable difference: 2.8 x the bootstrap standard error (80% power at two-sided 5%).
- secondary: mean length, truncation share, share of claim lines that are the reference's next step; a greedy
  held-out eval with --eval-limit N > 0 (off by default: it does not fit the hour).

Each run trains in OUT/train/ARM_sS (a finished run is skipped, an interrupted one resumed). Writes
OUT/results.json, OUT/table.md and the plot (--plot). Wall time: the training subprocesses' (model load included).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from paired import REPO, bootstrap, grpo, last_checkpoint, read_jsonl, save_figure

sys.path.insert(0, str(REPO))

from grpo_cli.rewards.steps import chain_steps  # noqa: E402

ARMS = ("outcome", "process")


def finished(run: Path, steps: int) -> bool:
    ckpt = last_checkpoint(run)
    return ckpt is not None and int(ckpt.name[5:]) >= steps


def train(arm: str, seed: int, steps: int, out: Path, extra: list[str]) -> dict:
    run = out / "train" / f"{arm}_s{seed}"
    timing = run / "wall_s.json"
    if not finished(run, steps):
        resume = last_checkpoint(run) is not None
        print(f"train {arm} seed {seed} -> {run}" + (" (resumed)" if resume else ""), flush=True)
        how = [f"resume={run}"] if resume else [f"+recipe=multistep_{arm}", f"trainer.seed={seed}",
                                                f"trainer.max_steps={steps}", "trainer.report_to=[]",
                                                "trainer.num_completions_to_print=0", f"hydra.run.dir={run}", *extra]
        wall = grpo("train", *how, log=out / "logs" / f"train_{arm}_s{seed}.log")
        timing.write_text(json.dumps({"wall_s": wall, "resumed": resume}))
    wall = json.loads(timing.read_text())["wall_s"] if timing.exists() else None
    return {"arm": arm, "seed": seed, "run": str(run), "wall_s": wall}


def check_paired(seed: int, outcome: list[dict], process: list[dict]) -> None:
    """Both arms of a seed drew the same prompts and, before any update differed, the same completions."""
    first = [[(r["prompt_id"], r["completion"]) for r in lines if r["step"] == 1] for lines in (outcome, process)]
    if not first[0] or first[0] != first[1]:
        sys.exit(f"seed {seed}: the arms' step-1 completions differ; the pairing is broken (same seed, same prompts, "
                 f"same sampling seeds expected)")
    prompts = [sorted({(r["step"], r["prompt_id"]) for r in lines}) for lines in (outcome, process)]
    if prompts[0] != prompts[1]:
        sys.exit(f"seed {seed}: the arms drew different prompts")


def per_prompt(lines: list[dict], steps: set[int], key) -> dict[tuple[int, int], float]:
    """(step, prompt_id) -> mean of key(line) over that prompt's G completions, for the steps in `steps`."""
    groups: dict[tuple[int, int], list[float]] = {}
    for r in lines:
        if r["step"] in steps:
            groups.setdefault((r["step"], r["prompt_id"]), []).append(float(key(r)))
    return {k: statistics.mean(v) for k, v in groups.items()}


def accuracy(r: dict) -> float:
    return r["rewards"]["accuracy"] or 0.0


def solution_of(seed: int):
    """prompt_id -> the reference solution: the run's stream is PromptStream(data.train, seed) (CompletionsLog)."""
    from grpo_cli.data import PromptStream, load_task

    stream = PromptStream(load_task("multistep").train, seed)
    return lambda prompt_id: stream[prompt_id]["solution"]


def chain_share(lines: list[dict], solution) -> float:
    """Share of claim lines that fill their slot with the reference's step (the chain judge's +1)."""
    right = total = 0
    for r in lines:
        # unwritten slots score NaN here and no answer is given: what is left are the claim lines' own steps (the
        # slots end on the last claim line now, so their place no longer tells them apart)
        steps = chain_steps(r["completion"], solution(r["prompt_id"]), missing=math.nan)
        body = [s for _, s in steps if not math.isnan(s)]
        right += sum(s > 0 for s in body)
        total += len(body)
    return right / max(total, 1)


def summarize(runs: list[dict], window: int, steps: int, draws: int) -> dict:
    last = set(range(steps - window + 1, steps + 1))
    lines = {(r["arm"], r["seed"]): read_jsonl(Path(r["run"]) / "completions.jsonl") for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    diffs, per_seed = {}, []
    for seed in seeds:
        check_paired(seed, lines["outcome", seed], lines["process", seed])
        acc = {arm: per_prompt(lines[arm, seed], last, accuracy) for arm in ARMS}
        keys = sorted(acc["outcome"])
        diffs[seed] = [acc["process"][k] - acc["outcome"][k] for k in keys]
        solution = solution_of(seed)
        row = {"seed": seed, "prompts": len(keys), "d": statistics.mean(diffs[seed])}
        for arm in ARMS:
            window_lines = [r for r in lines[arm, seed] if r["step"] in last]
            row[arm] = {"accuracy": statistics.mean(acc[arm].values()),
                        "truncated": statistics.mean(r["truncated"] for r in window_lines),
                        "length": statistics.mean(r["length"] for r in window_lines),
                        "chain_steps": chain_share(window_lines, solution),
                        "curve": {key: [statistics.mean(fn(r) for r in lines[arm, seed] if r["step"] == s)
                                        for s in range(1, steps + 1)]
                                  for key, fn in (("accuracy", accuracy), ("length", lambda r: r["length"]),
                                                  ("truncated", lambda r: r["truncated"]))}}
        per_seed.append(row)
    low, high, se = bootstrap(diffs, draws)
    d = statistics.mean(row["d"] for row in per_seed)
    trunc = {arm: statistics.mean(row[arm]["truncated"] for row in per_seed) for arm in ARMS}
    positive = sum(row["d"] > 0 for row in per_seed)
    verdict = low > 0 and positive >= len(seeds) - 1 and trunc["process"] <= trunc["outcome"] + 0.05
    return {"window": sorted(last), "d": d, "ci": [low, high], "se": se, "detectable": 2.8 * se,
            "seeds_positive": positive, "truncated": trunc, "process_beats_outcome": verdict, "per_seed": per_seed}


def probe_line(run: dict, window: int, steps: int) -> str:
    """One run's curves, for choosing the learning rate: accuracy, length and truncated share per step, and the
    endpoint window's against steps 1-2."""
    lines = read_jsonl(Path(run["run"]) / "completions.jsonl")
    at = {s: [r for r in lines if r["step"] == s] for s in range(1, steps + 1)}

    def mean(fn, which) -> float:
        return statistics.mean(fn(r) for s in which for r in at[s])

    early, late = (1, 2), range(steps - window + 1, steps + 1)
    curve = " ".join(f"{s}:{mean(accuracy, [s]):.2f}/{mean(lambda r: r['length'], [s]):.0f}/"
                     f"{mean(lambda r: r['truncated'], [s]):.2f}" for s in at)
    return (f"{run['arm']} seed {run['seed']} ({run['wall_s'] or 0:.0f} s) step:accuracy/length/truncated {curve}\n"
            f"  steps 1-2 -> window: truncated {mean(lambda r: r['truncated'], early):.3f} -> "
            f"{mean(lambda r: r['truncated'], late):.3f}, length {mean(lambda r: r['length'], early):.1f} -> "
            f"{mean(lambda r: r['length'], late):.1f}, accuracy {mean(accuracy, early):.3f} -> "
            f"{mean(accuracy, late):.3f}")


def table(results: dict) -> str:
    s = results["summary"]
    rows = ["| seed | outcome acc | process acc | d (process - outcome) | truncated (o / p) | length (o / p) | "
            "reference steps among claim lines (o / p) | train wall (o / p) |", "|---|---|---|---|---|---|---|---|"]
    walls = {(r["arm"], r["seed"]): r["wall_s"] for r in results["runs"]}
    for row in s["per_seed"]:
        o, p = row["outcome"], row["process"]
        rows.append(f"| {row['seed']} | {o['accuracy']:.3f} | {p['accuracy']:.3f} | {row['d']:+.3f} | "
                    f"{o['truncated']:.2f} / {p['truncated']:.2f} | {o['length']:.1f} / {p['length']:.1f} | "
                    f"{o['chain_steps']:.2f} / {p['chain_steps']:.2f} | "
                    f"{walls['outcome', row['seed']]:.0f} s / {walls['process', row['seed']]:.0f} s |")

    def mean(arm: str, key: str) -> float:
        return statistics.mean(row[arm][key] for row in s["per_seed"])

    def sd(arm: str) -> float:
        values = [row[arm]["accuracy"] for row in s["per_seed"]]
        return statistics.stdev(values) if len(values) > 1 else 0.0

    rows.append(f"| mean | {mean('outcome', 'accuracy'):.3f} ± {sd('outcome'):.3f} | "
                f"{mean('process', 'accuracy'):.3f} ± {sd('process'):.3f} | **{s['d']:+.3f}** "
                f"(95% CI {s['ci'][0]:+.3f} … {s['ci'][1]:+.3f}) | {s['truncated']['outcome']:.2f} / "
                f"{s['truncated']['process']:.2f} | {mean('outcome', 'length'):.1f} / "
                f"{mean('process', 'length'):.1f} | "
                f"{mean('outcome', 'chain_steps'):.2f} / {mean('process', 'chain_steps'):.2f} | |")
    return "\n".join(rows) + (
        f"\n\nEndpoint: sampled accuracy on the fresh prompts of steps {s['window'][0]}-{s['window'][-1]}, paired by "
        f"(seed, step, prompt); d > 0 in {s['seeds_positive']} of {len(s['per_seed'])} seeds; bootstrap SE "
        f"{s['se']:.3f}, detectable difference (80% power) {s['detectable']:.3f}. Process beats outcome by the "
        f"rule fixed in advance: **{'yes' if s['process_beats_outcome'] else 'no'}**.\n")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = results["summary"]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    for ax, key, title in zip(axes, ("accuracy", "length", "truncated"),
                              ("training-sample accuracy", "completion length (tokens)", "truncated share")):
        for arm, color in zip(ARMS, ("tab:blue", "tab:orange")):
            curves = [row[arm]["curve"][key] for row in s["per_seed"]]
            columns = list(zip(*curves))
            steps = list(range(1, len(columns) + 1))
            ax.plot(steps, [statistics.mean(c) for c in columns], color=color, label=f"{arm} (mean of {len(curves)})")
            ax.fill_between(steps, [min(c) for c in columns], [max(c) for c in columns], color=color, alpha=0.2)
        ax.axvspan(s["window"][0] - 0.5, s["window"][-1] + 0.5, color="grey", alpha=0.1)
        ax.set_title(title)
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
    axes[0].legend()
    ax = axes[3]
    seeds = [row["seed"] for row in s["per_seed"]]
    ax.bar([str(x) for x in seeds], [row["d"] for row in s["per_seed"]], color="tab:green")
    ax.axhline(s["d"], color="k", label=f"mean {s['d']:+.3f}")
    ax.axhspan(s["ci"][0], s["ci"][1], color="k", alpha=0.1, label="95% CI")
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_title("paired d = process - outcome, per seed")
    ax.set_xlabel("seed")
    ax.legend()
    fig.suptitle("multistep: outcome vs outcome + process credit · endpoint window shaded", fontsize=10)
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0,1,2,3,4,5", help="training seeds (trainer.seed), comma-separated")
    parser.add_argument("--steps", type=int, default=16, help="trainer.max_steps of every run")
    parser.add_argument("--window", type=int, default=8, help="the endpoint's last training steps")
    parser.add_argument("--boot", type=int, default=10_000, help="bootstrap draws")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "process_vs_outcome")
    parser.add_argument("--plot", type=Path, default=REPO / "docs" / "process_vs_outcome.png")
    parser.add_argument("--arms", default=",".join(ARMS),
                        help="arms to train; one arm alone (the learning-rate probe) prints its curves, no comparison")
    parser.add_argument("overrides", nargs="*", help="more overrides for both recipes (key=value)")
    args = parser.parse_args()
    if not 1 <= args.window <= args.steps:
        sys.exit(f"--window ({args.window}) must be between 1 and --steps ({args.steps})")
    seeds = [int(s) for s in args.seeds.split(",")]
    out = args.out.resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    arms = args.arms.split(",")
    if not set(arms) <= set(ARMS):
        sys.exit(f"--arms ({args.arms}) must name some of {', '.join(ARMS)}")
    runs = [train(arm, seed, args.steps, out, list(args.overrides)) for seed in seeds for arm in arms]
    if set(arms) != set(ARMS):
        for r in runs:
            print(probe_line(r, args.window, args.steps))
        return
    results = {"runs": runs, "seeds": seeds, "steps": args.steps, "overrides": list(args.overrides),
               "summary": summarize(runs, args.window, args.steps, args.boot)}
    results["train_wall_s"] = sum(r["wall_s"] or 0 for r in runs)
    results["script_wall_s"] = time.perf_counter() - started
    (out / "results.json").write_text(json.dumps(results, indent=1))
    text = table(results)
    (out / "table.md").write_text(text)
    plot(results, args.plot)
    print(text)
    print(f"training {results['train_wall_s']:.0f} s in all ({len(runs)} runs); this invocation "
          f"{results['script_wall_s']:.0f} s; {out / 'results.json'}; plot {args.plot}")


if __name__ == "__main__":
    main()
