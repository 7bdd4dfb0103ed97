"""Does iterating pay? Iterative RL against a fixed reward model at a scale where retraining has right answers to
learn from, paired by seed.

    .venv/bin/python scripts/iterating_at_scale.py run       # 8 seeds x {iterative, fixed}, resumable (~4-5 h quiet)
    .venv/bin/python scripts/iterating_at_scale.py report    # table, interval, verdict: OUT/report.md, a PNG

Why: the first comparison (scripts/iterative_vs_fixed.py: 3 seeds, 3 iterations x 5 steps, 24 problems x 4 samples
a boundary, 100 eval problems) found d = -0.003 (95% -0.073 ... +0.067): too small to tell, and its boundaries held
few right answers. The like-with-like probe (scripts/staleness_matched.py, 2026-12-07) then showed that a reward
model retrained on the step-40 policy's samples ranks that policy's answers better than one given as much base
data (+0.125 within-prompt AUC, 95% +0.065 ... +0.184): the thing iterating is meant to fix happens by step 40 of
the default job. This experiment asks whether fixing it reaches the policy.

The design, fixed before any run:
- the starting reward model: `grpo rm sampler.temperature=0.5` (docs/reward-models.md's measured setting, the
  recipe's documented start; 64 problems x 4 samples, rm.seed=0) in OUT/rm, once. Its weights' sha256 goes into
  every result, so a run of a later session on another machine that trained a different start model is seen.
- arms, differing in `iterative.retrain` alone: iterative (true: the reward model is retrained on the current
  policy's samples at every boundary, as the paper's Algorithm 1) and fixed (false: iteration 0's model scores every
  iteration; the later boundaries sample and measure it the same way). Both `grpo train +recipe=iterative_from_rm
  reward.name_or_path=OUT/rm/model` with 4 iterations x 10 steps (40 steps: the policy the probe found the fixed
  model stale on was a step-40 one), rm.num_problems=64 x rm.samples_per_problem=8 a boundary (512 rows at the
  recipe's temperature 0.5; 16 prompts' 128 rows held out for the AUCs), no gate (`rm.min_auc=null`: a retrained
  model always scores the next iteration), the recipe's other settings, no guard (`trainer.guard=null`: a rewind in
  one arm and not the other would be a second difference), no in-run eval (the endpoint is `grpo eval`'s).
  Iteration 0's boundary is the same in both arms, so a seed's two runs are one run through step 10 and differ only
  from step 11.
- changed once before any endpoint was seen: the first try (4 samples a problem, the recipe's gate rm.min_auc=0.6)
  was stopped during its first run (iterative, seed 0), whose boundaries showed the gate deciding on 0-5 held-out
  prompts with both a right and a wrong answer (of 16): at 4 samples a prompt the policy is mostly all right or all
  wrong on a prompt, so the gate's within-prompt AUC was undefined (model kept) or rested on a handful of prompts
  at boundaries 2 and 3, and the iterative arm would mostly have kept iteration 1's model: a test of the gate, not
  of iterating. That run was not evaluated; its boundary records are not part of the results.
- seeds 0-7 (trainer.seed): a seed's arms see the same prompts with the same sampling seeds.
- eval: `grpo eval`, greedy accuracy by the task's rule (reward=arithmetic) on all 500 held-out problems, HF
  generate, of each run's step-40 checkpoint; the base model once on the same problems.
- primary endpoint: per seed d = accuracy(iterative) - accuracy(fixed); the mean of the 8 d with a 95% t-interval
  (t(0.975, 7) = 2.365).
- power, fixed before any run, with a planning sd of the per-seed d of s = 0.065 (the first comparison's three d:
  +0.06, -0.07, 0.00; its 100 eval problems carried more eval noise than 500 do, its 15 steps less training noise
  than 40): half-width = 2.365 x 0.065 / sqrt(8) = 0.054; the smallest true difference found (lower bound > 0) with
  80% power ~ (t(0.975, 7) + t(0.80, 7)) x s / sqrt(8) = (2.365 + 0.896) x 0.023 = 0.075. The report prints both
  figures again with the observed s.
- verdict, in this order: "pays" if the interval's lower bound > 0; "does not pay" if its upper bound < +0.05
  (a gain of 0.05 or more is excluded); otherwise "inconclusive". Fewer than 8 seeds with both arms: "incomplete",
  no verdict (an interim table says so).
- secondary endpoints (no verdict):
  - the mechanism: at boundaries 1-3, the within-prompt AUC on fresh held-out samples of the current policy of the
    model that scores the coming iteration (iterative: the retrained model, `rm/auc_current_policy`; fixed: the
    fixed model, `rm/auc_current_policy_before`), each arm on its own policy's samples; per seed the mean over the
    boundaries where both arms measured one, iterative - fixed, with a t-interval over the seeds that have one.
  - the training samples' accuracy by the rule (`rewards/accuracy/mean`, weight 0 in the reward) over steps 11-40,
    per seed iterative - fixed, with a t-interval.
  - truncation and length: the held-out truncated share and mean length at step 40, per arm.
  - wall times (train, eval) per arm.

Resumable: each finished (arm, seed) writes OUT/results/ARM_sSEED.json (atomically, after its eval); a re-run runs
only what is missing, seed by seed, and an (arm, seed) whose run or eval was interrupted starts again from step 0 in
an empty folder. OUT defaults to experiments/iterating_at_scale/, whose .gitignore keeps results/ and report.md in
git (commit each result as it lands); weights stay out, so a later session on a new machine trains the start model
again (about 90 s) and goes on. Uses the product's own commands (`grpo rm`, `grpo train`, `grpo eval` in
subprocesses of this interpreter), each command's output in OUT/logs/. `-- OVERRIDES` adds overrides to every
command; `--seeds`, `--iterations`, `--steps` and `--problems` are for a check (e.g. `--out /tmp/ias --seeds 0
--iterations 2 --steps 1 --problems 4 --plot /tmp/ias.png run -- model=tiny` checks the plumbing on the tiny model).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
from pathlib import Path

from credit_experiment import _log, eval_base, final_checkpoint, fresh, read_eval, result_path
from credit_sparse import training_curve
from paired import REPO, finished, grpo, read_jsonl, save_figure, t975, t_interval, write_json

ARMS = ("iterative", "fixed")
SEEDS = tuple(range(8))
ITERATIONS, STEPS, PROBLEMS, SAMPLES = 4, 10, 64, 8
HELDOUT = 500
# grpo eval: greedy, the task's rule, HF generate (as the training runs, which iterative RL keeps on HF generate)
EVAL = ["reward=arithmetic", "sampler=short", f"eval.limit={HELDOUT}", "eval.num_samples=0"]
T80_7 = 0.896  # t(0.80, 7): 80% power at n = 8
PLANNING_SD = 0.065
DOES_NOT_PAY_BELOW = 0.05


def start_model(out: Path, extra: list[str]) -> tuple[Path, str]:
    """The starting reward model (OUT/rm/model, trained once) and its weights' sha256."""
    folder = out / "rm"
    model = folder / "model"
    if not (model / "model.safetensors").exists():
        fresh(folder)
        print(f"grpo rm -> {folder}", flush=True)
        wall = grpo("rm", "sampler.temperature=0.5", f"hydra.run.dir={folder}", *extra, log=_log(out, "rm"))
        write_json(out / "results" / "rm.json", {"rm_s": wall, **_rm_eval(folder), "sha256": _sha(model)})
    return model, _sha(model)


def _rm_eval(folder: Path) -> dict:
    path = folder / "rm_eval.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _sha(model: Path) -> str:
    with (model / "model.safetensors").open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def train_command(arm: str, seed: int, model: Path, run: Path, sizes: tuple[int, int, int], extra: list[str]):
    iterations, steps, problems = sizes
    return ["train", "+recipe=iterative_from_rm", f"reward.name_or_path={model}",
            f"iterative.retrain={arm == 'iterative'}", f"iterative.iterations={iterations}",
            f"iterative.steps={steps}", f"trainer.max_steps={iterations * steps}",
            f"rm.num_problems={problems}", f"rm.samples_per_problem={SAMPLES}", "rm.min_auc=null",
            f"trainer.seed={seed}", "trainer.guard=null", "trainer.eval_every=null",
            "trainer.report_to=[]", f"hydra.run.dir={run}", *extra]


def boundaries(run: Path) -> list[dict]:
    """Each boundary of a run (iterations.jsonl), the numbers the report reads."""
    keys = ("iteration", "step", "rows", "positives", "train_new", "train_replay", "heldout", "kept_previous",
            "rm/auc_current_policy_before", "rm/auc_current_policy_after", "rm/auc_current_policy", "rm/auc_prompts",
            "rm/pooled_auc_current_policy_before", "rm/pooled_auc_current_policy_after", "time/sample_s", "time/rm_s")
    return [{k: b.get(k) for k in keys} for b in read_jsonl(run / "iterations.jsonl")]


def per_problem(folder: Path) -> list[int]:
    """1/0 per held-out problem, in index order (for a problem-level look at d)."""
    rows = sorted(read_jsonl(folder / "eval_samples.jsonl"), key=lambda r: r["index"])
    return [int(bool(r["correct"])) for r in rows]


def run_one(out: Path, arm: str, seed: int, model: Path, sha: str, sizes, extra: list[str]) -> dict:
    """Train one (arm, seed) from step 0 in an empty folder, evaluate its last checkpoint, then write its result."""
    name = f"{arm}_s{seed}"
    run, folder = out / "train" / name, out / "eval" / name
    fresh(run, folder)
    print(f"{arm} seed {seed} -> {run}", flush=True)
    train_s = grpo(*train_command(arm, seed, model, run, sizes, extra), log=_log(out, f"train_{name}"))
    ckpt = final_checkpoint(run, sizes[0] * sizes[1], _log(out, f"train_{name}"))
    eval_s = grpo("eval", f"checkpoint={ckpt}", *EVAL, f"hydra.run.dir={folder}", *extra,
                  log=_log(out, f"eval_{name}"))
    row = read_eval(folder)
    result = {"arm": arm, "seed": seed, "checkpoint": str(ckpt), "start_rm_sha256": sha,
              "accuracy": row["accuracy"], "truncated": row["truncation_rate"], "length": row.get("mean_length"),
              "correct": per_problem(folder), "train_s": train_s, "eval_s": eval_s,
              "boundaries": boundaries(run), "curve": training_curve(run)}
    write_json(result_path(out, arm, seed), result)
    return result


def verdict(diffs: list[float], planned: int = len(SEEDS)) -> str:
    """The rule fixed before the runs (module docstring), on the per-seed differences iterative - fixed."""
    if len(diffs) < planned:
        return f"incomplete ({len(diffs)} of {planned} seeds): no verdict"
    _, low, high = t_interval(diffs)
    if low > 0:
        return "pays"
    if high < DOES_NOT_PAY_BELOW:
        return "does not pay"
    return "inconclusive"


def scoring_auc(result: dict, arm: str) -> dict[int, float]:
    """Boundary -> within-prompt AUC on the current policy's held-out samples of the model that scores the coming
    iteration (boundaries 1 on; None where no held-out prompt held both labels)."""
    key = "rm/auc_current_policy" if arm == "iterative" else "rm/auc_current_policy_before"
    return {b["iteration"]: b[key] for b in result["boundaries"] if b["iteration"] >= 1 and b[key] is not None}


def _after_first(result: dict) -> float:
    """The training samples' mean accuracy from the first step the arms can differ on (iteration 1's, step 11)."""
    first = next(b["step"] for b in result["boundaries"] if b["iteration"] == 1)
    return statistics.mean(result["curve"]["accuracy"][first - 1:])


def _interval(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    mean, low, high = t_interval(values)
    return {"n": len(values), "mean": mean, "lower": low, "upper": high}


def summarize(results: list[dict], base: dict | None, planned: int = len(SEEDS)) -> dict:
    by = {(r["arm"], r["seed"]): r for r in results}
    seeds = sorted(s for s in {r["seed"] for r in results} if all((a, s) in by for a in ARMS))
    rows, mech, train_d = [], [], []
    for s in seeds:
        i, f = by["iterative", s], by["fixed", s]
        ai, af = scoring_auc(i, "iterative"), scoring_auc(f, "fixed")
        common = sorted(set(ai) & set(af))
        m = statistics.mean(ai[b] - af[b] for b in common) if common else None
        if m is not None:
            mech.append(m)
        train_d.append(_after_first(i) - _after_first(f))
        rows.append({"seed": s, "iterative": i["accuracy"], "fixed": f["accuracy"], "d": i["accuracy"] - f["accuracy"],
                     "auc_iterative": ai, "auc_fixed": af, "auc_d": m, "train_d": train_d[-1],
                     "truncated": (i["truncated"], f["truncated"]), "length": (i["length"], f["length"]),
                     "train_s": (i["train_s"], f["train_s"]), "eval_s": (i["eval_s"], f["eval_s"])})
    diffs = [r["d"] for r in rows]
    n = len(diffs)
    sd = statistics.stdev(diffs) if n >= 2 else None
    t = t975(n - 1)
    shas = {r.get("start_rm_sha256") for r in results}
    return {"rows": rows, "base": base, "primary": _interval(diffs), "sd": sd, "verdict": verdict(diffs, planned),
            "observed_half": t * sd / n ** 0.5 if sd else None,
            "observed_detectable": (t + T80_7) * sd / n ** 0.5 if sd else None,
            "planned_half": t975(planned - 1) * PLANNING_SD / planned ** 0.5,
            "planned_detectable": (t975(planned - 1) + T80_7) * PLANNING_SD / planned ** 0.5,
            "mechanism": _interval(mech), "training": _interval(train_d), "start_models": len(shas)}


def markdown(s: dict) -> str:
    fmt = lambda v: "–" if v is None else f"{v:.2f}"  # noqa: E731
    auc = lambda d: ", ".join(f"{fmt(d.get(b))}" for b in (1, 2, 3))  # noqa: E731
    lines = ["| seed | iterative | fixed | d | scoring model's within-prompt AUC at boundaries 1-3: iterative / fixed "
             "| train accuracy 11-40, d | truncated i / f | train s i / f |",
             "|---|---|---|---|---|---|---|---|"]
    for r in s["rows"]:
        lines.append(f"| {r['seed']} | {r['iterative']:.3f} | {r['fixed']:.3f} | {r['d']:+.3f} | "
                     f"{auc(r['auc_iterative'])} / {auc(r['auc_fixed'])} | {r['train_d']:+.3f} | "
                     f"{r['truncated'][0]:.3f} / {r['truncated'][1]:.3f} | "
                     f"{r['train_s'][0]:.0f} / {r['train_s'][1]:.0f} |")
    p = s["primary"]
    base = f"{s['base']['accuracy']:.3f}" if s["base"] else "not yet measured"
    text = "\n".join(lines) + f"\n\nBase model (no adapter) {base}."
    if p["n"] >= 2:
        text += (f" Mean d (iterative - fixed) over {p['n']} seeds **{p['mean']:+.3f}**, 95% t-interval "
                 f"{p['lower']:+.3f} … {p['upper']:+.3f}; sd of d {s['sd']:.3f} (planned 0.065): half-width "
                 f"{s['observed_half']:.3f} (planned {s['planned_half']:.3f}), detectable with 80% power "
                 f"{s['observed_detectable']:.3f} (planned {s['planned_detectable']:.3f}).")
    text += f"\n\nVerdict by the rule fixed before the runs: **{s['verdict']}**.\n"
    for key, what in (("mechanism", "scoring model's within-prompt AUC, iterative - fixed (mean over boundaries)"),
                      ("training", "training samples' accuracy over steps 11-40, iterative - fixed")):
        m = s[key]
        if m["n"] >= 2:
            text += (f"\nSecondary, {what}: {m['mean']:+.3f} (95% {m['lower']:+.3f} … {m['upper']:+.3f}, "
                     f"{m['n']} seeds).")
    if s["start_models"] > 1:
        text += f"\n\nThe results used {s['start_models']} different start models (sha256): see results/*.json."
    return text + "\n"


def plot(results: list[dict], s: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    colors = {"iterative": "tab:orange", "fixed": "tab:blue"}
    for arm in ARMS:
        curves = [r["curve"]["accuracy"] for r in results if r["arm"] == arm]
        for c in curves:
            axes[0].plot(range(1, len(c) + 1), c, color=colors[arm], alpha=0.25)
        if curves:
            width = min(len(c) for c in curves)
            mean = [statistics.mean(c[k] for c in curves) for k in range(width)]
            axes[0].plot(range(1, width + 1), mean, color=colors[arm], lw=2.5, label=f"{arm} (mean of {len(curves)})")
    for r in s["rows"]:
        axes[1].plot([0, 1], [r["fixed"], r["iterative"]], "o-", color="gray", alpha=0.7)
        for arm in ("fixed", "iterative"):
            b = r[f"auc_{arm}"]
            axes[2].plot(sorted(b), [b[k] for k in sorted(b)], "o-", color=colors[arm], alpha=0.6)
    if s["base"]:
        axes[1].axhline(s["base"]["accuracy"], color="black", ls=":", label="base model")
    axes[1].set_xticks([0, 1], ["fixed", "iterative"])
    for ax, title in zip(axes, ("training samples' accuracy by the rule (per step)",
                                "held-out greedy accuracy at step 40, per seed (500 problems)",
                                "scoring model's within-prompt AUC on the current policy\n"
                                "(orange iterative, blue fixed)")):
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_xlabel("step")
    axes[2].set_xlabel("boundary (iteration)")
    axes[2].xaxis.set_major_locator(MaxNLocator(integer=True))  # boundaries are whole iterations, however many
    axes[0].legend(fontsize=8)
    axes[1].legend(fontsize=8)
    p = s["primary"]
    head = f"d = {p['mean']:+.3f} (95% {p['lower']:+.3f} … {p['upper']:+.3f})" if p["n"] >= 2 else "fewer than 2 seeds"
    fig.suptitle(f"iterative vs fixed reward model, {p['n']} seeds: {head}; {s['verdict']}", fontsize=10)
    save_figure(fig, path)


def report(out: Path, plot_path: Path | None = None, planned: int = len(SEEDS)) -> str:
    results, base = finished(out)
    s = summarize(results, base, planned)
    text = markdown(s)
    (out / "report.md").write_text(text)
    if plot_path is not None and s["rows"]:
        plot(results, s, plot_path)
    print(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=("run", "report"))
    # in the repository: git keeps results/ and report.md (its .gitignore), so the runs go on in a later session
    parser.add_argument("--out", type=Path, default=REPO / "experiments" / "iterating_at_scale")
    parser.add_argument("--seeds", type=int, nargs="*", default=SEEDS, help="a subset, for a check")
    parser.add_argument("--iterations", type=int, default=ITERATIONS, help="fewer, for a check only")
    parser.add_argument("--steps", type=int, default=STEPS, help="fewer, for a check only")
    parser.add_argument("--problems", type=int, default=PROBLEMS, help="fewer, for a check only")
    parser.add_argument("--plot", type=Path, default=REPO / "docs" / "iterating_at_scale.png")
    args, extra = parser.parse_known_args()
    extra = [e for e in extra if e != "--"]
    out = args.out.resolve()
    if args.command == "run":
        model, sha = start_model(out, extra)
        eval_base(out, lambda folder: ["eval", *EVAL, f"hydra.run.dir={folder}", *extra])
        sizes = (args.iterations, args.steps, args.problems)
        for seed in args.seeds:
            for arm in ARMS:
                if not result_path(out, arm, seed).exists():
                    run_one(out, arm, seed, model, sha, sizes, extra)
    report(out, args.plot, len(args.seeds) if args.seeds != SEEDS else len(SEEDS))


if __name__ == "__main__":
    main()
