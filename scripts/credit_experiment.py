"""Does step credit pay on multi-step arithmetic? Outcome vs outcome + step credit, with the power to tell (issue #44).

    .venv/bin/python scripts/credit_experiment.py calibrate        # warm starts, then 8 samples: pick (~35 min quiet)
    .venv/bin/python scripts/credit_experiment.py run              # 3 arms x 10 seeds, resumable (~3-4 h quiet)
    .venv/bin/python scripts/credit_experiment.py report           # table, interval, verdict -> OUT/report.md

The design, fixed before any run:
- task and starting policy: `data=multistep`, the candidate `calibrate` picks from CANDIDATES by the rule: at least
  3 steps and a sampled accuracy of its starting policy (8 samples per problem at the candidate's temperature,
  pass@1, a truncated completion wrong; 64 held-out problems) in [0.2, 0.4], the one closest to 0.3, so that most
  outcome groups of 8 carry a gradient (1 - 0.7^8 = 94% at 0.3, against 34% at the last experiment's 0.05). None in
  range: stop and say so. The choice and the numbers go to OUT/calibration.json before `run` starts; `run` reads
  them.
- why not the base model: its first calibration (2026-12-03, docs/process-supervision.md) had every candidate at
  0.04-0.06 sampled (greedy 0.08-0.16). A candidate now also fixes (a) the temperature both arms sample at in
  training (`sampler.temperature`; calibrate measures at it; the loss scores the policy's own softmax as at 1, so
  below 1 the rollouts are sharper than the policy the loss reads, alike in every arm) and (b) the policy both arms
  start from: the base model, or a warm start (WARM_STARTS): outcome-reward GRPO (`multistep_outcome` + SHAPING, the
  reward every arm shares, not the step credit under test) on a trainer seed outside SEEDS, so other prompts of the
  same train split and never a held-out one. Its last adapter is every arm's `model.init_adapter` (β = 0: no
  reference is read). It is trained once by `calibrate` (OUT/warm/KEY, kept; `run` reuses it), so the 30 runs start
  from one file: both arms of a seed still start from the same policy, with the same prompts and sampling seeds.
  The candidates were screened on 32 problems x 8 before this design was committed (the commit's body).
- arms, differing in the reward alone: O = `+recipe=multistep_outcome` (accuracy, group-normalized);
  P = `+recipe=multistep_process` (A_outcome + 1·A_process, the chain judge's step credit, reward.credit=sum);
  O+ = P with `reward.scorer.at_end=true` (the same step scores, all on the EOS: one sequence-level reward as dense
  as P's, so O+ vs P separates where the credit goes from how dense it is).
- shared: the same `algo.overlong_*` shaping in every arm (SHAPING: DAPO's soft penalty over the last 16 tokens
  before the 48-token cap), 24 steps, the recipes' other settings (4 prompts x G=8, β=0, dr_grpo, LoRA, lr 3e-4);
  fresh seeds 100-109 (trainer.seed), each arm on each seed.
- primary endpoint: greedy accuracy (a truncated completion wrong) on 200 held-out problems (`grpo eval`,
  eval.limit=200, the task's held-out split) of the step-24 checkpoint; per seed d = P - O; the mean of the 10
  per-seed differences with a 95% t-interval (t(0.975, 9) = 2.262).
- verdict: "pays" if the interval's lower bound > 0, d > 0 in >= 8 of 10 seeds, and P's held-out truncated share
  <= 5% and <= its step-1 share + 5 points; "does not pay" if the upper bound < +0.03; otherwise "inconclusive".
  P's held-out truncated share: the mean over seeds of its step-24 greedy truncated share on the 200 problems; its
  step-1 share: that of the policy it starts from (the base model or the warm start, the same 200 problems,
  evaluated once).
- detectable difference: with n = 10 and s the sd of the per-seed differences, the interval's half-width is
  t(0.975, 9)·s/√10 ≈ 0.715·s; a true difference of (t(0.975, 9) + t(0.80, 9))·s/√10 ≈ 0.995·s is found (lower
  bound > 0) with 80% power. The report prints both with the observed s.
- secondary (no verdict): O+ - O and P - O+ with the same interval; held-out truncated shares; wall times.

Resumable: each finished (arm, seed) writes OUT/results/ARM_sSEED.json (atomically, after its eval); a re-run runs
only what is missing, and an (arm, seed) whose run or eval was interrupted starts again from step 0 in an empty
folder, so the endpoint does not depend on where a session ended. Across sessions (each on a fresh machine): OUT
defaults to experiments/credit/, whose .gitignore keeps calibration.json, results/ and report.md in git (commit each
result as it lands); weights stay out, so a later session trains the warm start again, and `run` stops unless that
run repeats calibration's step by step (rewards, lengths, loss, KL: `warm_trace`). Uses the
product's own commands (`grpo train`, `grpo eval` in subprocesses of this interpreter). Pass `-- OVERRIDES` to
add overrides to every command (e.g. `-- model=tiny` to check the script on the tiny model).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
from pathlib import Path

from paired import REPO, finished, grpo, last_checkpoint, read_jsonl, save_figure, t975, t_interval, write_json

ARMS = {"O": ["+recipe=multistep_outcome"], "P": ["+recipe=multistep_process"],
        "O+": ["+recipe=multistep_process", "reward.scorer.at_end=true"]}
SEEDS = list(range(100, 110))
STEPS = 24
HELDOUT = 200
# the same soft overlong penalty in every arm (the recipes' cap is 48 new tokens)
SHAPING = ["algo.overlong_buffer=16", "algo.overlong_penalty=1.0"]
# what every training run of the design adds: no logger, no printed completions, no in-run eval and no guard.
# trainer.guard came after this regime's runs, which trained their fixed steps unguarded; on by default, it stopped
# a sparse-regime P run at step 8 on its length tripwire (its answers grew as it learned the steps): a rewind or a
# stop in one arm would make the arms differ in more than the reward
PLAIN = ["trainer.report_to=[]", "trainer.num_completions_to_print=0", "trainer.eval_every=null", "trainer.guard=null"]
# the multi-step configurations calibrate measures: name -> its data overrides, the steps of a solution, the
# temperature both arms sample at in training (calibrate measures at it) and the policy both arms start from
# ("base": the base model; else a key of WARM_STARTS, whose last adapter both arms load: model.init_adapter)
ADD3 = ["data.num_operands=4", "data.operators=[+]"]
# the base model's add3, addsub3_4shot and add4 were measured out of range (0.064, 0.037, 0.047 sampled at
# temperature 1: docs/process-supervision.md) and are not measured again
CANDIDATES = {
    "add3_warm": {"data": ADD3, "steps": 3, "temperature": 1.0, "start": "add3_o40"},
    # the same start, sampled at 0.7 by both arms: sharper rollouts, a higher sampled accuracy
    "add3_warm_t07": {"data": ADD3, "steps": 3, "temperature": 0.7, "start": "add3_o40"},
    # a curriculum: the start learned two-step chains, the arms train on three
    "add3_from_add2": {"data": ADD3, "steps": 3, "temperature": 1.0, "start": "add2_o40"},
    # added after the first calibration (2026-12-04: add3_warm 0.633, add3_warm_t07 0.660 sampled, above the band),
    # before any arm ran: the add3_o40 run's training accuracy crossed 0.3 at its steps 33-36, so the same warm start
    # stopped at step 34
    "add3_warm34": {"data": ADD3, "steps": 3, "temperature": 1.0, "start": "add3_o34"},
}
# warm starts: outcome-reward GRPO (recipes/multistep_outcome.yaml with SHAPING) on `data` at `temperature`, on a
# trainer seed outside SEEDS (other prompts of the same train split, never a held-out problem), `steps` steps
WARM_STARTS = {
    # the task itself; 40 steps as the default job's (which took 2-operand addition from 0.245 to 0.625 greedy)
    "add3_o40": {"data": ADD3, "temperature": 1.0, "seed": 900, "steps": 40},
    # two-step chains, where the base model is right more often, so more of its groups carry a gradient
    # (its 729 distinct problems hold a held-out split of at most 362: 200 here; the arms never read add2's)
    "add2_o40": {"data": ["data.num_operands=3", "data.operators=[+]", "data.heldout_size=200"], "temperature": 1.0,
                 "seed": 901, "steps": 40},
    # add3_o40's first 34 steps (the same seed, data and settings; the learning rate is constant)
    "add3_o34": {"data": ADD3, "temperature": 1.0, "seed": 900, "steps": 34},
}
CALIBRATION = {"problems": 64, "samples": 8, "low": 0.2, "high": 0.4, "target": 0.3, "min_steps": 3}
# what every eval scores with: the held-out split, accuracy with a truncated completion wrong, the training cap
EVAL = ["reward=arithmetic", "reward.functions.accuracy.wrong_if_truncated=true", "sampler=short",
        "sampler.max_new_tokens=48"]
# t(0.975, df): paired.t975
T80_9 = 0.883   # t(0.80, 9): 80% power at n = 10


def final_checkpoint(run: Path, steps: int, log: Path) -> Path:
    """The run's checkpoint of step `steps`, which its eval scores; one line and exit when the run ended elsewhere."""
    ckpt = last_checkpoint(run)
    if ckpt is None or ckpt.name != f"step_{steps:06d}":
        sys.exit(f"{run.name}: the run's last checkpoint is {ckpt.name if ckpt else 'none'}, not step {steps}: "
                 f"the design evaluates step {steps}; see {log}")
    return ckpt


def result_path(out: Path, arm: str, seed: int) -> Path:
    return out / "results" / f"{arm.replace('+', 'plus')}_s{seed}.json"


def pending(out: Path, arms=tuple(ARMS), seeds=SEEDS) -> list[tuple[str, int]]:
    """(arm, seed) pairs without a result file, seed by seed, so an interrupted campaign leaves whole seeds."""
    return [(arm, seed) for seed in seeds for arm in arms if not result_path(out, arm, seed).exists()]


def fresh(*folders: Path) -> None:
    """An unfinished (arm, seed) starts again from nothing: its partial run and eval folders are removed."""
    for folder in folders:
        if folder.exists():
            shutil.rmtree(folder)


def read_eval(folder: Path) -> dict:
    """The one checkpoint row of a `grpo eval` run: greedy accuracy, pass@k, truncated share."""
    rows = json.loads((folder / "eval.json").read_text())["results"]
    return rows[-1]


def calibrate(out: Path, extra: list[str], names=tuple(CANDIDATES)) -> dict:
    """Sampled accuracy of each candidate's starting policy at its temperature; the rule above picks one. Writes
    OUT/calibration.json (a re-run measures again: the choice is made on one set of numbers)."""
    found = {}
    for name in names:
        candidate = CANDIDATES[name]
        start = start_policy(out, name, extra)
        folder = out / "calibrate" / name
        fresh(folder)
        wall = grpo("eval", *start, "data=multistep", *candidate["data"], *EVAL,
                    f"eval.limit={CALIBRATION['problems']}", f"eval.num_samples={CALIBRATION['samples']}",
                    f"eval.k=[1,{CALIBRATION['samples']}]",
                    f"eval.temperature={candidate['temperature']}", f"hydra.run.dir={folder}", *extra,
                    log=_log(out, f"calibrate_{name}"))
        row = read_eval(folder)
        found[name] = {**candidate, "sampled_accuracy": row["pass@k"]["1"], "greedy_accuracy": row["accuracy"],
                       "truncated": row["truncation_rate"], "wall_s": wall}
        print(f"{name}: sampled {found[name]['sampled_accuracy']:.3f}, greedy {found[name]['greedy_accuracy']:.3f}, "
              f"truncated {found[name]['truncated']:.2f} ({wall:.0f} s)", flush=True)
    chosen = choose_task(found)
    starts = {CANDIDATES[n]["start"] for n in names} - {"base"}
    traces = {key: warm_trace(warm_start(out, key, extra)) for key in sorted(starts)}
    report = {"rule": CALIBRATION, "warm_starts": WARM_STARTS, "warm_trace": traces, "candidates": found,
              "chosen": chosen}
    write_json(out / "calibration.json", report)
    print(f"chosen: {chosen}" if chosen else "no candidate in range: the experiment does not start", flush=True)
    return report


def warm_start(out: Path, key: str, extra: list[str]) -> Path:
    """Warm start `key` of WARM_STARTS (trained once, kept: OUT/warm/KEY); returns its last checkpoint."""
    warm, run = WARM_STARTS[key], out / "warm" / key
    ckpt = last_checkpoint(run) if run.exists() else None
    # its metrics.jsonl too: check_warm_start compares that run's trace, so a checkpoint alone is trained again
    if ckpt is not None and ckpt.name == f"step_{warm['steps']:06d}" and (run / "metrics.jsonl").exists():
        return ckpt
    fresh(run)
    print(f"warm start {key} -> {run}", flush=True)
    grpo("train", "+recipe=multistep_outcome", *warm["data"], *SHAPING, f"sampler.temperature={warm['temperature']}",
         f"trainer.seed={warm['seed']}", f"trainer.max_steps={warm['steps']}", f"trainer.save_every={warm['steps']}",
         *PLAIN, f"hydra.run.dir={run}", *extra,
         log=_log(out, f"warm_{key}"))
    return last_checkpoint(run)


TRACE = ("reward", "completions/mean_length", "loss", "kl")  # a warm start's per-step numbers that must repeat


def warm_trace(ckpt: Path) -> list[list[float]]:
    """The warm start's run, step by step (TRACE of its metrics.jsonl): what `run` compares in a later session,
    where the warm start is trained again (weights stay out of git; a second training repeats these numbers exactly
    but not the adapter's last bits: gradient norms 1.5e-6 apart)."""
    return [[row[key] for key in TRACE] for row in read_jsonl(ckpt.parent.parent / "metrics.jsonl")]


def check_warm_start(out: Path, name: str, calibration: dict, extra: list[str]) -> None:
    """Stop unless candidate `name`'s warm start repeats, step by step, the run calibration measured."""
    start = CANDIDATES[name]["start"]
    if start == "base":
        return
    expected = calibration.get("warm_trace", {}).get(start)
    if expected is not None and warm_trace(warm_start(out, start, extra)) != expected:
        sys.exit(f"warm start {start}: its training run does not repeat the one calibration measured (TRACE of "
                 f"metrics.jsonl): the seeds already run started from another policy; do not mix them")


def start_policy(out: Path, name: str, extra: list[str]) -> list[str]:
    """The `grpo eval` overrides that load candidate `name`'s starting policy: none for the base model, the warm
    start's checkpoint otherwise (trained first if missing)."""
    start = CANDIDATES[name]["start"]
    return [] if start == "base" else [f"checkpoint={warm_start(out, start, extra)}"]


def arm_settings(out: Path, name: str, extra: list[str]) -> list[str]:
    """What every arm's `grpo train` adds for candidate `name`: its task, its temperature, its starting adapter."""
    candidate, start = CANDIDATES[name], []
    if candidate["start"] != "base":
        start = [f"model.init_adapter={warm_start(out, candidate['start'], extra)}"]
    return [*candidate["data"], f"sampler.temperature={candidate['temperature']}", *start]


def choose_task(found: dict) -> str | None:
    """The candidate with enough steps whose sampled accuracy is in range, closest to the target; None if none."""
    rule = CALIBRATION
    fits = [n for n, c in found.items() if c["steps"] >= rule["min_steps"]
            and rule["low"] <= c["sampled_accuracy"] <= rule["high"]]
    return min(fits, key=lambda n: abs(found[n]["sampled_accuracy"] - rule["target"])) if fits else None


def run_one(out: Path, arm: str, seed: int, task: str, extra: list[str], steps: int) -> dict:
    """Train one (arm, seed) on candidate `task` from step 0, evaluate its last checkpoint, and only then write its
    result."""
    name = f"{arm.replace('+', 'plus')}_s{seed}"
    run, folder = out / "train" / name, out / "eval" / name
    fresh(run, folder)
    print(f"{arm} seed {seed} -> {run}", flush=True)
    data = CANDIDATES[task]["data"]
    train_s = grpo("train", *ARMS[arm], *arm_settings(out, task, extra), *SHAPING, f"trainer.seed={seed}",
                   f"trainer.max_steps={steps}", *PLAIN, f"hydra.run.dir={run}", *extra,
                   log=_log(out, f"train_{arm}_s{seed}"))
    ckpt = final_checkpoint(run, steps, _log(out, f"train_{arm}_s{seed}"))
    eval_s = grpo("eval", f"checkpoint={ckpt}", "data=multistep", *data, *EVAL, f"eval.limit={HELDOUT}",
                  "eval.num_samples=0", f"hydra.run.dir={folder}", *extra, log=_log(out, f"eval_{arm}_s{seed}"))
    row = read_eval(folder)
    result = {"arm": arm, "seed": seed, "checkpoint": str(ckpt), "accuracy": row["accuracy"],
              "truncated": row["truncation_rate"], "length": row.get("mean_length"), "train_s": train_s,
              "eval_s": eval_s, "curve": training_curve(run)}
    write_json(result_path(out, arm, seed), result)
    return result


def training_curve(run: Path) -> dict:
    """Per step of a run (metrics.jsonl): the training samples' accuracy and mean completion length, kept in its
    result so the report can draw the curves where the run folders are gone (another session's machine)."""
    rows = read_jsonl(run / "metrics.jsonl")
    return {"accuracy": [r["rewards/accuracy/mean"] for r in rows],
            "length": [r["completions/mean_length"] for r in rows]}


def run_base(out: Path, name: str, extra: list[str]) -> dict:
    """The policy every arm starts from (the base model or the warm start), on the same held-out problems: its
    greedy accuracy and its truncated share (the step-1 share of the truncation guard)."""
    return eval_base(out, lambda folder: ["eval", *start_policy(out, name, extra), "data=multistep",
                                          *CANDIDATES[name]["data"], *EVAL, f"eval.limit={HELDOUT}",
                                          "eval.num_samples=0", f"hydra.run.dir={folder}", *extra])


def eval_base(out: Path, argv) -> dict:
    """The starting policy's eval, once (OUT/results/base.json; `argv(folder)`: the `grpo eval` command writing into
    folder): its greedy accuracy, truncated share and wall time."""
    path = out / "results" / "base.json"
    if path.exists():
        return json.loads(path.read_text())
    folder = out / "eval" / "base"
    fresh(folder)
    wall = grpo(*argv(folder), log=_log(out, "eval_base"))
    row = read_eval(folder)
    base = {"accuracy": row["accuracy"], "truncated": row["truncation_rate"], "eval_s": wall}
    write_json(path, base)
    return base


def verdict(diffs: list[float], p_truncated: float, p_truncated_step1: float, planned: int = len(SEEDS)) -> str:
    """The rule fixed before the runs (module docstring), on the per-seed differences P - O."""
    if len(diffs) < planned:
        return f"incomplete ({len(diffs)} of {planned} seeds)"
    _, low, high = t_interval(diffs)
    positive = sum(d > 0 for d in diffs)
    if low > 0 and positive >= 8 and p_truncated <= 0.05 and p_truncated <= p_truncated_step1 + 0.05:
        return "pays"
    if high < 0.03:
        return "does not pay"
    return "inconclusive"


def summarize(results: list[dict], base: dict | None) -> dict:
    """Per seed with all three arms: accuracies, d = P - O and the secondary differences; the interval and verdict."""
    by = {(r["arm"], r["seed"]): r for r in results}
    seeds = sorted(s for s in {r["seed"] for r in results} if all((a, s) in by for a in ARMS))
    rows = [{"seed": s, **{a: by[a, s]["accuracy"] for a in ARMS}, **{f"{a} truncated": by[a, s]["truncated"]
                                                                    for a in ARMS}} for s in seeds]
    diff = {name: [r[x] - r[y] for r in rows] for name, (x, y) in
            {"P - O": ("P", "O"), "O+ - O": ("O+", "O"), "P - O+": ("P", "O+")}.items()}
    p_trunc = statistics.mean(r["P truncated"] for r in rows) if rows else math.nan
    step1 = base["truncated"] if base else math.nan
    intervals = {name: t_interval(d) if d else (math.nan,) * 3 for name, d in diff.items()}
    sd = statistics.stdev(diff["P - O"]) if len(rows) > 1 else math.nan
    return {"rows": rows, "diffs": diff, "intervals": intervals, "positive": sum(d > 0 for d in diff["P - O"]),
            "p_truncated": p_trunc, "p_truncated_step1": step1, "sd": sd,
            "half_width": t975(9) * sd / math.sqrt(10), "detectable": (t975(9) + T80_9) * sd / math.sqrt(10),
            "verdict": verdict(diff["P - O"], p_trunc, step1)}


def markdown(s: dict) -> str:
    """The report's table and lines, for docs/process-supervision.md."""
    lines = ["| seed | O | P | O+ | d = P − O | truncated O / P / O+ |", "|---|---|---|---|---|---|"]
    for r in s["rows"]:
        lines.append(f"| {r['seed']} | {r['O']:.3f} | {r['P']:.3f} | {r['O+']:.3f} | {r['P'] - r['O']:+.3f} | "
                     f"{r['O truncated']:.2f} / {r['P truncated']:.2f} / {r['O+ truncated']:.2f} |")
    lines.append("")
    for name, (mean, low, high) in s["intervals"].items():
        lines.append(f"- {name}: {mean:+.3f} (95% t-interval {low:+.3f} … {high:+.3f})")
    lines.append(f"- d > 0 in {s['positive']} of {len(s['rows'])} seeds; P's held-out truncated share "
                 f"{s['p_truncated']:.3f} (step 1: {s['p_truncated_step1']:.3f})")
    lines.append(f"- sd of the per-seed differences s = {s['sd']:.3f}: half-width t(0.975, 9)·s/√10 = "
                 f"{s['half_width']:.3f}; detectable with 80% power ≈ 0.995·s = {s['detectable']:.3f}")
    lines.append(f"- verdict (rule fixed before the runs): **{s['verdict']}**")
    return "\n".join(lines) + "\n"


COLORS = {"O": "tab:blue", "P": "tab:orange", "O+": "tab:green"}


def plot(results: list[dict], s: dict, base: dict | None, path: Path) -> None:
    """Three panels: the training samples' accuracy per step (mean over seeds, min-max band; results with a
    curve), the endpoint per seed with each seed's arms joined, and the paired differences with their intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, ends, diffs) = plt.subplots(1, 3, figsize=(15, 4))
    for arm in ARMS:
        drawn = [r["curve"]["accuracy"] for r in results if r["arm"] == arm and r.get("curve")]
        if not drawn:
            continue
        columns = list(zip(*drawn))  # [steps][seeds]; runs of one arm have the same number of steps
        steps = range(1, len(columns) + 1)
        curves.plot(steps, [statistics.mean(c) for c in columns], color=COLORS[arm], label=f"{arm} ({len(drawn)})")
        curves.fill_between(steps, [min(c) for c in columns], [max(c) for c in columns], color=COLORS[arm],
                            alpha=0.15)
    curves.set(title="training samples' accuracy (mean, min-max over seeds)", xlabel="step", ylim=(0, 1))
    curves.legend()
    x = range(len(ARMS))
    for r in s["rows"]:
        ends.plot(x, [r[a] for a in ARMS], color="grey", alpha=0.5, marker="o", ms=3)
    if s["rows"]:
        ends.plot(x, [statistics.mean(r[a] for r in s["rows"]) for a in ARMS], color="k", marker="D", lw=2,
                  label="mean over seeds")
    if base:
        ends.axhline(base["accuracy"], color="tab:red", ls=":", label=f"start {base['accuracy']:.3f}")
    ends.set(xticks=list(x), xticklabels=list(ARMS), title=f"greedy held-out accuracy, step {STEPS} (per seed)",
             ylim=(0, 1))
    ends.legend()
    for i, (name, (mean, low, high)) in enumerate(s["intervals"].items()):
        values = s["diffs"][name]
        diffs.scatter([i + 0.1 * ((j % 5) - 2) for j in range(len(values))], values, color="grey", s=12)
        if values and math.isfinite(low):
            diffs.errorbar([i + 0.35], [mean], yerr=[[mean - low], [high - mean]], color="k", marker="D", capsize=4)
    diffs.axhline(0, color="grey", lw=0.8)
    diffs.axhline(0.03, color="tab:red", ls="--", lw=0.8, label="+0.03: 'does not pay' below")
    diffs.set(xticks=range(len(s["intervals"])), xticklabels=list(s["intervals"]),
              title="paired differences: per seed, mean and 95% t-interval")
    diffs.legend()
    fig.suptitle(f"step credit on multi-step arithmetic (issue #44): {len(s['rows'])} seeds; verdict: "
                 f"{s['verdict']}", fontsize=10)
    save_figure(fig, path)


def report(out: Path, plot_path: Path | None = None) -> str:
    results, base = finished(out)
    s = summarize(results, base)
    text = markdown(s)
    (out / "report.md").write_text(text)
    if plot_path is not None:
        plot(results, s, base, plot_path)
    print(text)
    return text


def _log(out: Path, name: str) -> Path:
    (out / "logs").mkdir(parents=True, exist_ok=True)
    return out / "logs" / f"{name}.log"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=("calibrate", "run", "report"))
    # in the repository: git keeps its calibration.json, results/ and report.md (its .gitignore), so the experiment
    # goes on in a later session on another machine
    parser.add_argument("--out", type=Path, default=REPO / "experiments" / "credit")
    parser.add_argument("--seeds", type=int, nargs="*", default=SEEDS, help="a subset, for a check")
    parser.add_argument("--plot", type=Path, default=REPO / "docs" / "credit_experiment.png",
                        help="report: the figure (training curves, per-seed endpoints, paired differences)")
    parser.add_argument("--steps", type=int, default=STEPS, help="fewer, for a check only")
    parser.add_argument("--candidates", nargs="*", choices=tuple(CANDIDATES), help="calibrate: these only")
    args, extra = parser.parse_known_args()
    extra = [e for e in extra if e != "--"]
    if args.command == "calibrate":
        calibrate(args.out, extra, args.candidates or tuple(CANDIDATES))
    elif args.command == "run":
        calibration = args.out / "calibration.json"
        measured = json.loads(calibration.read_text()) if calibration.exists() else {}
        chosen = measured.get("chosen")
        if chosen is None:
            sys.exit(f"no calibrated task in {calibration}: run `calibrate` first (the design picks the task from it)")
        check_warm_start(args.out, chosen, measured, extra)
        run_base(args.out, chosen, extra)
        for arm, seed in pending(args.out, seeds=args.seeds):
            run_one(args.out, arm, seed, chosen, extra, args.steps)
        report(args.out, args.plot)
    else:
        report(args.out, args.plot)


if __name__ == "__main__":
    main()
