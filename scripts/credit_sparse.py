"""Does step credit pay where rewards are sparse? Outcome vs outcome + step credit from the base model on add3
(issue #61).

    .venv/bin/python scripts/credit_sparse.py run       # 2 arms x 10 seeds + the base eval, resumable (~2.5-3 h quiet)
    .venv/bin/python scripts/credit_sparse.py report    # table, interval, verdict, interaction: OUT/report.md, a PNG

The design, fixed before any run: the dense regime's (scripts/credit_experiment.py, whose 20 O and P runs are the
comparison regime) except where said.
- regime: the base model (no warm start: no `model.init_adapter`) on add3 (`data=multistep` with ADD3: three
  additions of one-digit operands), sampled at temperature 1 in training. Its sampled accuracy there was 0.064
  (64 held-out problems x 8 at temperature 1, 2026-12-03, docs/process-supervision.md), so an outcome group of 8
  carries a gradient with probability 1 - 0.936^8 ≈ 41%, against ~94% at the dense regime's warm start, while the
  step credit gives a signal in almost every group: where step credit should matter most.
- arms, differing in the reward alone: O = `+recipe=multistep_outcome`; P = `+recipe=multistep_process`
  (A_outcome + 1·A_process). No O+.
- shared: the same `algo.overlong_*` shaping (SHAPING), 24 steps, the recipes' other settings (4 prompts x G=8,
  β=0, dr_grpo, LoRA, lr 3e-4); seeds 100-109 (trainer.seed), each arm on each seed, so both arms of a seed see
  the same prompts with the same sampling seeds.
- eval: greedy accuracy (a truncated completion wrong) on 200 held-out problems (`grpo eval`, eval.limit=200, the
  task's held-out split) of the step-24 checkpoint; the base model itself once on the same problems
  (results/base.json: where both arms start).
- primary endpoint: per seed d = P - O; the mean of the 10 per-seed differences with a 95% t-interval
  (t(0.975, 9) = 2.262).
- power, fixed before any run, with a planning sd of the per-seed differences s ≈ 0.055:
  half-width = t(0.975, 9)·s/√10 = 2.262 x 0.055 / 3.1623 = 0.0393 ≈ 0.039;
  the smallest true difference found (lower bound > 0) with 80% power ≈ (t(0.975, 9) + t(0.80, 9))·s/√10
  = (2.262 + 0.883) / 3.1623 x 0.055 = 0.9945 x 0.055 = 0.0547, about 0.055 (the issue's "0.054" cuts it to three
  decimals; t quantiles in a normal approximation, not the noncentral t). The dense regime's observed s was 0.061
  (half-width 0.043, detectable 0.060); this regime's own s may differ, and the report prints both figures with it.
- verdict, its clauses checked in this order:
  1. "pays" if the interval's lower bound > 0 and P's held-out truncated share <= O's + 0.05 (each the mean over
     the 10 seeds of the step-24 greedy truncated share on the 200 problems; shares are multiples of 1/2000,
     compared with a 1e-9 tolerance so that float rounding of a mean does not decide a tie);
  2. "does not pay" if the upper bound < +0.05 (so a lower bound > 0 with the truncation guard failed and an
     upper bound < +0.05 reads "does not pay");
  3. otherwise "inconclusive". Fewer than 10 seeds with both arms: "incomplete", no verdict.
- secondary endpoints (no verdict):
  - the regime x arm interaction: (P - O)_sparse - (P - O)_dense, the dense regime's per-seed d from its O and P
    results (experiments/credit/results/, seeds 100-109). Unpaired: the difference of the two means with a Welch
    interval, SE = √(s_sparse²/10 + s_dense²/10), the Welch-Satterthwaite df, t(0.975, ⌊df⌋) (df rounded down: a
    slightly wider interval). Not paired by seed: the regimes start from different policies, so a seed's runs in
    the two share only the prompt order, and neither design pairs across regimes. Planned: s_sparse = 0.055 and
    the dense s_dense = 0.0606 give SE = √(0.0003025 + 0.0003667) = 0.0259 and df = 17.8, so t(0.975, 17) = 2.110,
    half-width 2.110 x 0.0259 = 0.055, and an interaction found with 80% power ≈ (2.110 + 0.863) x 0.0259 = 0.077.
  - the area under the training-accuracy curve: per run, the mean over its 24 steps of the training samples'
    accuracy (metrics.jsonl `rewards/accuracy/mean`: the area under the per-step curve divided by 24); per arm the
    mean over seeds, and P - O per seed with a 95% t-interval.
  - truncation: each arm's held-out truncated share at step 24 (the guard's numbers) and P - O of it with a 95%
    t-interval; each arm's training truncated share (`completions/clipped_ratio`), the mean over steps and seeds.
  - wall times (train and eval per arm, in all).

Resumable as the dense regime: each finished (arm, seed) writes OUT/results/ARM_sSEED.json (atomically, after its
eval); a re-run runs only what is missing, and an (arm, seed) whose run or eval was interrupted starts again from
step 0 in an empty folder. OUT defaults to experiments/credit_sparse/, whose .gitignore keeps results/ and
report.md in git (commit each result as it lands); weights stay out. There is no warm start to train again: a later
session goes on from the results alone. Uses the product's own commands (`grpo train`, `grpo eval` in subprocesses
of this interpreter); each command's output is in OUT/logs/. Pass `-- OVERRIDES` to add overrides to every command, and
`--seeds`/`--steps` for a check (e.g. `--out /tmp/sparse --seeds 100 --steps 2 --plot /tmp/sparse.png run --
model=tiny` checks the plumbing on the tiny model).
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

import credit_experiment as dense
from credit_experiment import ADD3, EVAL, HELDOUT, PLAIN, SEEDS, SHAPING, STEPS, T80_9, final_checkpoint, result_path
from paired import REPO, finished, grpo, read_jsonl, save_figure, t975, t_interval, write_json

ARMS = {arm: dense.ARMS[arm] for arm in ("O", "P")}
# the base model's sampled accuracy on add3 (0.064) was measured at temperature 1; both arms sample there
TEMPERATURE = 1.0
# the verdict's thresholds (module docstring)
DOES_NOT_PAY_BELOW = 0.05
TRUNCATION_MARGIN = 0.05


def pending(out: Path, seeds=SEEDS) -> list[tuple[str, int]]:
    """(arm, seed) pairs without a result file, seed by seed."""
    return dense.pending(out, tuple(ARMS), seeds)


def train_command(arm: str, seed: int, steps: int, run: Path, extra: list[str]) -> list[str]:
    """`grpo train` for one (arm, seed): the base model (no init_adapter) on add3 at temperature 1."""
    return ["train", *ARMS[arm], *ADD3, f"sampler.temperature={TEMPERATURE}", *SHAPING, f"trainer.seed={seed}",
            f"trainer.max_steps={steps}", *PLAIN, f"hydra.run.dir={run}", *extra]


def eval_command(ckpt: Path | None, folder: Path, extra: list[str]) -> list[str]:
    """`grpo eval`, greedy on the 200 held-out add3 problems, of a checkpoint or (None) the base model."""
    start = [] if ckpt is None else [f"checkpoint={ckpt}"]
    return ["eval", *start, "data=multistep", *ADD3, *EVAL, f"eval.limit={HELDOUT}", "eval.num_samples=0",
            f"hydra.run.dir={folder}", *extra]


def training_curve(run: Path) -> dict:
    """The dense regime's per-step curve (accuracy, length) and the training samples' truncated share."""
    rows = read_jsonl(run / "metrics.jsonl")
    return {**dense.training_curve(run), "truncated": [r["completions/clipped_ratio"] for r in rows]}


def run_one(out: Path, arm: str, seed: int, extra: list[str], steps: int) -> dict:
    """Train one (arm, seed) from step 0 in an empty folder, evaluate its last checkpoint, and only then write its
    result."""
    name = f"{arm}_s{seed}"
    run, folder = out / "train" / name, out / "eval" / name
    dense.fresh(run, folder)
    print(f"{arm} seed {seed} -> {run}", flush=True)
    train_s = grpo(*train_command(arm, seed, steps, run, extra), log=dense._log(out, f"train_{name}"))
    ckpt = final_checkpoint(run, steps, dense._log(out, f"train_{name}"))
    eval_s = grpo(*eval_command(ckpt, folder, extra), log=dense._log(out, f"eval_{name}"))
    row = dense.read_eval(folder)
    result = {"arm": arm, "seed": seed, "checkpoint": str(ckpt), "accuracy": row["accuracy"],
              "truncated": row["truncation_rate"], "length": row.get("mean_length"), "train_s": train_s,
              "eval_s": eval_s, "curve": training_curve(run)}
    write_json(result_path(out, arm, seed), result)
    return result


def run_base(out: Path, extra: list[str]) -> dict:
    """The base model on the same 200 held-out problems, once: where both arms start."""
    return dense.eval_base(out, lambda folder: eval_command(None, folder, extra))


def verdict(diffs: list[float], p_truncated: float, o_truncated: float, planned: int = len(SEEDS)) -> str:
    """The rule fixed before the runs (module docstring), on the per-seed differences P - O."""
    if len(diffs) < planned:
        return f"incomplete ({len(diffs)} of {planned} seeds)"
    _, low, high = t_interval(diffs)
    if low > 0 and p_truncated <= o_truncated + TRUNCATION_MARGIN + 1e-9:
        return "pays"
    if high < DOES_NOT_PAY_BELOW:
        return "does not pay"
    return "inconclusive"


def welch(a: list[float], b: list[float]) -> tuple[float, float, float, float]:
    """(mean(a) - mean(b), lower, upper, df): the 95% Welch interval of a difference of two independent means,
    t at the Welch-Satterthwaite df rounded down."""
    mean = statistics.mean(a) - statistics.mean(b)
    if len(a) < 2 or len(b) < 2:
        return mean, -math.inf, math.inf, math.nan
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    if va + vb == 0:
        return mean, mean, mean, math.inf
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    half = t975(df) * math.sqrt(va + vb)
    return mean, mean - half, mean + half, df


def auc(curve: dict | None) -> float | None:
    """The area under a run's training-accuracy curve over its steps, divided by the steps: the mean."""
    return statistics.mean(curve["accuracy"]) if curve else None


def paired_rows(results: list[dict]) -> list[dict]:
    """Per seed with both arms O and P: accuracy, truncated share, AUC and walls of each arm."""
    by = {(r["arm"], r["seed"]): r for r in results}
    seeds = sorted(s for s in {r["seed"] for r in results} if all((a, s) in by for a in ARMS))
    return [{"seed": s, **{a: by[a, s]["accuracy"] for a in ARMS},
             **{f"{a} truncated": by[a, s]["truncated"] for a in ARMS},
             **{f"{a} auc": auc(by[a, s].get("curve")) for a in ARMS}} for s in seeds]


def _mean(values) -> float:
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else math.nan


def _interval(values: list[float]) -> tuple[float, float, float]:
    return t_interval(values) if values else (math.nan,) * 3


def summarize(results: list[dict], base: dict | None, dense_results: list[dict]) -> dict:
    """The primary endpoint, its verdict and power figures, and the secondary endpoints."""
    rows = paired_rows(results)
    d = [r["P"] - r["O"] for r in rows]
    dense_rows = paired_rows([r for r in dense_results if r["arm"] in ARMS])
    d_dense = [r["P"] - r["O"] for r in dense_rows]
    truncated = {a: _mean(r[f"{a} truncated"] for r in rows) for a in ARMS}
    aucs = [r for r in rows if r["O auc"] is not None and r["P auc"] is not None]
    sd = statistics.stdev(d) if len(d) > 1 else math.nan
    runs = [r for r in results if r["arm"] in ARMS]
    walls = {a: {"train": _mean(r.get("train_s") for r in runs if r["arm"] == a),
                 "eval": _mean(r.get("eval_s") for r in runs if r["arm"] == a)} for a in ARMS}
    total = sum((r.get("train_s") or 0) + (r.get("eval_s") or 0) for r in runs) + ((base or {}).get("eval_s") or 0)
    return {"rows": rows, "d": d, "interval": _interval(d), "sd": sd,
            "half_width": t975(9) * sd / math.sqrt(10), "detectable": (t975(9) + T80_9) * sd / math.sqrt(10),
            "truncated": truncated, "verdict": verdict(d, truncated["P"], truncated["O"]),
            "d_dense": d_dense, "dense_interval": _interval(d_dense),
            "interaction": welch(d, d_dense) if d and d_dense else (math.nan,) * 4,
            "auc": {a: _mean(r[f"{a} auc"] for r in aucs) for a in ARMS},
            "auc_diff": _interval([r["P auc"] - r["O auc"] for r in aucs]), "auc_seeds": len(aucs),
            "truncated_diff": _interval([r["P truncated"] - r["O truncated"] for r in rows]),
            "train_truncated": {a: _mean(statistics.mean(r["curve"]["truncated"]) for r in runs
                                         if r["arm"] == a and r.get("curve") and r["curve"].get("truncated"))
                                for a in ARMS},
            "walls": walls, "runs": len(runs), "total_s": total, "base": base}


def markdown(s: dict) -> str:
    """The report's table and lines, for docs/process-supervision.md."""
    lines = ["| seed | O | P | d = P − O | truncated O / P | training AUC O / P |", "|---|---|---|---|---|---|"]
    for r in s["rows"]:
        auc_text = (f"{r['O auc']:.3f} / {r['P auc']:.3f}" if r["O auc"] is not None and r["P auc"] is not None
                    else "–")
        lines.append(f"| {r['seed']} | {r['O']:.3f} | {r['P']:.3f} | {r['P'] - r['O']:+.3f} | "
                     f"{r['O truncated']:.2f} / {r['P truncated']:.2f} | {auc_text} |")
    lines.append("")
    if s["base"]:
        lines.append(f"- start (the base model, same 200 problems): greedy {s['base']['accuracy']:.3f}, truncated "
                     f"{s['base']['truncated']:.3f}")
    mean, low, high = s["interval"]
    lines.append(f"- P - O: {mean:+.3f} (95% t-interval {low:+.3f} … {high:+.3f}), d > 0 in "
                 f"{sum(x > 0 for x in s['d'])} of {len(s['d'])} seeds")
    lines.append(f"- held-out truncated share at step {STEPS}: O {s['truncated']['O']:.3f}, "
                 f"P {s['truncated']['P']:.3f} (the guard: P <= O + {TRUNCATION_MARGIN:.2f})")
    lines.append(f"- sd of the per-seed differences s = {s['sd']:.3f}: half-width t(0.975, 9)·s/√10 = "
                 f"{s['half_width']:.3f}; detectable with 80% power ≈ 0.995·s = {s['detectable']:.3f} "
                 f"(planned with s = 0.055: 0.039 and 0.055)")
    lines.append(f"- verdict (rule fixed before the runs): **{s['verdict']}**")
    lines.append("")
    lines.append("Secondary (no verdict):")
    dm, dl, dh = s["dense_interval"]
    im, il, ih, df = s["interaction"]
    lines.append(f"- (P − O)_sparse − (P − O)_dense: {im:+.3f} (95% Welch interval {il:+.3f} … {ih:+.3f}, "
                 f"df {df:.1f}); dense P − O {dm:+.3f} ({dl:+.3f} … {dh:+.3f}, {len(s['d_dense'])} seeds)")
    am, al, ah = s["auc_diff"]
    lines.append(f"- training-accuracy AUC (mean over {STEPS} steps): O {s['auc']['O']:.3f}, P {s['auc']['P']:.3f}; "
                 f"P − O {am:+.3f} (95% t-interval {al:+.3f} … {ah:+.3f}, {s['auc_seeds']} seeds)")
    tm, tl, th = s["truncated_diff"]
    lines.append(f"- truncation: held-out P − O {tm:+.3f} (95% t-interval {tl:+.3f} … {th:+.3f}); training samples "
                 f"(mean over steps) O {s['train_truncated']['O']:.3f}, P {s['train_truncated']['P']:.3f}")
    walls = ", ".join(f"{a}: train {w['train']:.0f} s, eval {w['eval']:.0f} s" for a, w in s["walls"].items())
    lines.append(f"- wall times per run (mean): {walls}; {s['runs']} runs and the base eval: "
                 f"{s['total_s'] / 3600:.2f} h in all")
    return "\n".join(lines) + "\n"


COLORS = {"O": "tab:blue", "P": "tab:orange"}


def plot(results: list[dict], dense_results: list[dict], s: dict, path: Path) -> None:
    """Three panels: the training samples' accuracy per step (sparse: mean and min-max over seeds; dense: mean,
    dashed), the endpoint per seed with each seed's arms joined, and P - O per seed in each regime with its
    interval and the interaction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, ends, diffs) = plt.subplots(1, 3, figsize=(15, 4))
    for regime, runs, style in (("sparse", results, "-"), ("dense", dense_results, "--")):
        for arm in ARMS:
            drawn = [r["curve"]["accuracy"] for r in runs if r["arm"] == arm and r.get("curve")]
            if not drawn:
                continue
            columns = list(zip(*drawn))
            steps = range(1, len(columns) + 1)
            curves.plot(steps, [statistics.mean(c) for c in columns], color=COLORS[arm], ls=style,
                        alpha=1.0 if regime == "sparse" else 0.5, label=f"{arm} {regime} ({len(drawn)})")
            if regime == "sparse":
                curves.fill_between(steps, [min(c) for c in columns], [max(c) for c in columns], color=COLORS[arm],
                                    alpha=0.15)
    curves.set(title="training samples' accuracy (sparse: mean, min-max)", xlabel="step", ylim=(0, 1))
    curves.legend(fontsize=8)
    x = range(len(ARMS))
    for r in s["rows"]:
        ends.plot(x, [r[a] for a in ARMS], color="grey", alpha=0.5, marker="o", ms=3)
    if s["rows"]:
        ends.plot(x, [statistics.mean(r[a] for r in s["rows"]) for a in ARMS], color="k", marker="D", lw=2,
                  label="mean over seeds")
    if s["base"]:
        ends.axhline(s["base"]["accuracy"], color="tab:red", ls=":", label=f"base model {s['base']['accuracy']:.3f}")
    ends.set(xticks=list(x), xticklabels=list(ARMS), title=f"greedy held-out accuracy, step {STEPS} (per seed)",
             ylim=(0, 1))
    ends.legend(fontsize=8)
    for i, (values, (mean, low, high)) in enumerate(((s["d"], s["interval"]), (s["d_dense"], s["dense_interval"]))):
        diffs.scatter([i + 0.1 * ((j % 5) - 2) for j in range(len(values))], values, color="grey", s=12)
        if values and math.isfinite(low):
            diffs.errorbar([i + 0.35], [mean], yerr=[[mean - low], [high - mean]], color="k", marker="D", capsize=4)
    im, il, ih, _ = s["interaction"]
    if math.isfinite(il):
        diffs.errorbar([2.35], [im], yerr=[[im - il], [ih - im]], color="tab:purple", marker="D", capsize=4)
    diffs.axhline(0, color="grey", lw=0.8)
    diffs.axhline(DOES_NOT_PAY_BELOW, color="tab:red", ls="--", lw=0.8,
                  label="+0.05: 'does not pay' if the upper bound is below")
    diffs.set(xticks=[0, 1, 2], xticklabels=["P − O sparse", "P − O dense", "sparse − dense"],
              title="P − O per seed, mean and 95% interval")
    diffs.legend(fontsize=8)
    fig.suptitle(f"step credit with sparse rewards (base model, add3): {len(s['rows'])} seeds; verdict: "
                 f"{s['verdict']}", fontsize=10)
    save_figure(fig, path)


def report(out: Path, dense_out: Path, plot_path: Path | None = None) -> str:
    results, base = finished(out)
    dense_results = finished(dense_out)[0] if (dense_out / "results").exists() else []
    s = summarize(results, base, dense_results)
    text = markdown(s)
    (out / "report.md").write_text(text)
    if plot_path is not None:
        plot(results, dense_results, s, plot_path)
    print(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=("run", "report"))
    # in the repository: git keeps results/ and report.md (its .gitignore), so the runs go on in a later session
    parser.add_argument("--out", type=Path, default=REPO / "experiments" / "credit_sparse")
    parser.add_argument("--dense", type=Path, default=REPO / "experiments" / "credit",
                        help="the dense regime's folder (its results/O_s*.json, P_s*.json): the interaction")
    parser.add_argument("--seeds", type=int, nargs="*", default=SEEDS, help="a subset, for a check")
    parser.add_argument("--plot", type=Path, default=REPO / "docs" / "credit_sparse.png",
                        help="report: the figure (training curves, per-seed endpoints, P - O in both regimes)")
    parser.add_argument("--steps", type=int, default=STEPS, help="fewer, for a check only")
    args, extra = parser.parse_known_args()
    extra = [e for e in extra if e != "--"]
    if args.command == "run":
        run_base(args.out, extra)
        for arm, seed in pending(args.out, seeds=args.seeds):
            run_one(args.out, arm, seed, extra, args.steps)
    report(args.out, args.dense, args.plot)


if __name__ == "__main__":
    main()
