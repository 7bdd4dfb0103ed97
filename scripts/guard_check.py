"""The guard against a planted fault on the default job: does it catch a learning rate gone 30x too high, and does
the run end no worse than it was before the fault?

    .venv/bin/python scripts/guard_check.py run [OUT] [--seeds 0 1 2]  # 2 arms x 3 seeds of the default job, resumable
    .venv/bin/python scripts/guard_check.py report [OUT]               # the table and OUT/curves.png again
    .venv/bin/python scripts/guard_check.py kill [OUT] [--seeds 0]     # kill -9 of a guarded run, then its resume

The design, fixed before any run:
- the fault: from its 15th update on, the optimizer steps with 30x the learning rate it is given (3e-4 -> 9e-3 in
  the default job). It is planted as a user's optimizer class (OUT/plant/spiked.py, `optimizer._target_=spiked.
  SpikedAdamW`): AdamW that counts its own updates from its state, so a resume or a rewind to a checkpoint before
  update 15 meets the fault again at update 15, and the guard's lr remedy (x0.5 a rewind) scales the rate the
  fault multiplies. A fault that persists, as a wrong setting does: the guard cannot remove it, only slow it or
  stop the run.
- arms: unguarded (`trainer.guard=null`) and guarded (the default guard: conf/train.yaml's tripwires, 2 rewinds,
  then a stop at the last checkpoint that passed). Everything else is the default job (40 steps, evals of 200
  held-out problems at steps 10, 20, 30 and 40 with their Wilson intervals, checkpoints every 10 steps and at each
  eval), trainer.seed 0, 1, 2; the two arms of a seed draw the same prompts with the same sampling seeds, so they
  are the same run up to the first firing.
- the endpoints, per seed: B = the held-out accuracy of the best eval before the fault (step 10: the only eval
  before update 15, equal in both arms); U = the unguarded run's held-out accuracy at step 40; G = the held-out
  accuracy of the checkpoint the guarded run ends at (step 40's eval when it trains to the end; when it stops, the
  eval of the checkpoint it stopped at, read from its evals/ rows of that step).
- the claims, fixed before any run, each per seed:
  1. "the fault hurts": U < B, and U's Wilson interval lies wholly below B's (the guard's own gate);
  2. "the guard catches it": the guarded run writes at least one decision to guard.jsonl, rewinds, and applies
     the lr remedy (or stops);
  3. "the guarded run ends no worse": G >= B.
  Each claim is reported per seed (3 seeds): "holds in k of 3". No pooled statistic: with 3 seeds the design can
  show a fault the guard catches every time, not estimate a rate.
- false alarms are read elsewhere: the normal default job with the guard on, 3 seeds, is the K=0 arm of
  scripts/async_check.py accuracy (its guard.jsonl per seed); this script's runs share steps 1-14 with it only in
  design, not in engine (these sample in process).

The first run of the guarded arm (2026-12-06/07, OUT/first/) ended no worse in 1 of 3 seeds: two stopped at a
checkpoint that had passed the gate by its interval but scored below step 10's. A stop now goes to the best
evaluated checkpoint that passed (grpo_cli/guard.py, `stop_target`), and the guarded arm ran again into
OUT/results/ with the same claims; the unguarded arm has no guard, so its runs stand.

kill (after `run` has finished the guarded arm of the seed): the guarded run of that seed again, twice, each killed
with SIGKILL (its whole process group) once and then resumed (`grpo train resume=RUN trust_run_config=true`) to its
end: `eval`, during the first in-run eval after the fault (step 20's: the kill comes at the moment step 19 was
logged + the last 5 steps' median time + a quarter of the last eval's time, when step 20's update is done and its
eval runs;
the eval writes nothing until it ends, so the run folder cannot show it, and the report gives the timings); and
`rewind`, as soon as guard.jsonl has its first decision, before any step after the rewind. The claim, fixed before
running: each resumed run's guard.jsonl decisions and its final checkpoint's adapter equal the
uninterrupted guarded run's, tensor for tensor.

The first kill check (2026-12-07, seed 0, OUT/first/kill.md) failed before any kill: the killed runs' own steps
already differed from the uninterrupted run's from step 3 (losses ~1e-4 apart on the same completions), and so did
a second check sampled by HF generate, from step 4. The cause was the update's backward, not the engine (the
prompt-cache gather added gradients from two threads in any order; grpo_cli/kernels.py `take_rows` since). After
it, both checks were run again and hold, tensor for tensor: HF generate (`sampler=short`, the default job's 32
tokens, evals every 8 steps: sampled so, seed 0's guarded run fires first at step 17 and never reaches step 20, so
its first eval after the fault is step 16's) and the default job's in-process vLLM engine:

    .venv/bin/python scripts/guard_check.py run experiments/guard_hf --seeds 0 --arms guarded \
        -- sampler=short trainer.eval_every=8
    .venv/bin/python scripts/guard_check.py kill experiments/guard_hf --seeds 0 -- sampler=short trainer.eval_every=8
    .venv/bin/python scripts/guard_check.py run experiments/guard_vllm --seeds 0 --arms guarded
    .venv/bin/python scripts/guard_check.py kill experiments/guard_vllm --seeds 0

Resumable, across sessions (each on a fresh machine): a run that has logged its last step (or, guarded, whose
guard.jsonl ends in a stop) writes OUT/results/RUN.json (atomically: its metrics, its guard decisions, its last
checkpoint's name and a digest of that checkpoint's adapter), and the report and the kill's comparison read only
those. A run with a result is skipped; one cut short is resumed from its last checkpoint while its folder is there
(the same session), and started again from step 0 when it is not (a new machine); a killed run cut short before its
result is killed again from step 0. OUT defaults to experiments/guard/, whose .gitignore keeps results/, report.md
and curves.png in git (commit each result as it lands); run folders (weights, logs) stay out.
`-- OVERRIDES` adds overrides to every run (`run /tmp/gc -- model=tiny sampler.max_new_tokens=8` checks the
plumbing in minutes).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml
from paired import REPO, done, kept, last_checkpoint, read_jsonl, result, save_figure, train_or_resume, write_json

STEPS, FAULT_FROM, FACTOR = 40, 15, 30.0
ARMS = {"unguarded": ["trainer.guard=null"], "guarded": []}

SPIKED = '''"""AdamW whose learning rate is `factor` times the one it is given from its `spike_from`-th update on."""

import torch


class SpikedAdamW(torch.optim.AdamW):
    def __init__(self, params, spike_from: int = 15, factor: float = 30.0, **kwargs):
        super().__init__(params, **kwargs)
        self.spike_from, self.factor = spike_from, factor

    def updates(self) -> int:
        """The updates made so far, from the state a checkpoint restores (AdamW's per-parameter step count)."""
        steps = [float(s["step"]) for s in self.state.values() if "step" in s]
        return int(max(steps, default=0))

    @torch.no_grad()
    def step(self, closure=None):
        if self.updates() + 1 < self.spike_from:
            return super().step(closure)
        given = [group["lr"] for group in self.param_groups]
        for group in self.param_groups:
            group["lr"] = group["lr"] * self.factor
        try:
            return super().step(closure)
        finally:
            for group, lr in zip(self.param_groups, given):
                group["lr"] = lr
'''


def stops(decisions: list[dict]) -> bool:
    """Whether the guard's decisions end the run (a stop remedy)."""
    return any(d["remedy"] == "stop" for d in decisions)


def stopped(run: Path) -> bool:
    return stops(decisions(run))


def finished(run: Path) -> bool:
    return done(run, STEPS) or stopped(run)


def job(out: Path, arm: str, seed: int, extra: list[str]) -> tuple[list[str], Path, dict]:
    """(the overrides, the working folder, the environment) of an arm's run: the planted class written to
    OUT/plant, imported from there; grpo_cli from this checkout."""
    plant = out / "plant"
    plant.mkdir(parents=True, exist_ok=True)
    (plant / "spiked.py").write_text(SPIKED)
    args = [f"trainer.max_steps={STEPS}", f"trainer.seed={seed}", "trainer.report_to=[]",
            "optimizer._target_=spiked.SpikedAdamW", f"+optimizer.spike_from={FAULT_FROM}",
            f"+optimizer.factor={FACTOR}", *ARMS[arm], *extra]
    return args, plant, {**os.environ, "PYTHONPATH": str(REPO)}


def digest(checkpoint: Path) -> str:
    """sha256 over the adapter's tensors, name by name (equal digests: equal adapters, tensor for tensor)."""
    import torch
    from safetensors.torch import load_file

    tensors = load_file(checkpoint / "adapter_model.safetensors")
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return h.hexdigest()


def save_result(out: Path, run: Path, **more) -> dict:
    """OUT/results/RUN.json from a finished run's folder: what the report and the kill's comparison read."""
    last = last_checkpoint(run)
    saved = {"run": run.name, "metrics": read_jsonl(run / "metrics.jsonl"), "guard": decisions(run),
             "last_checkpoint": last.name, "adapter_sha256": digest(last), **more}
    write_json(out / "results" / f"{run.name}.json", saved)
    print(f"{run.name}: result in {out / 'results' / f'{run.name}.json'}", flush=True)
    return saved


def train(out: Path, arm: str, seed: int, extra: list[str]) -> None:
    run = out / "runs" / f"{arm}_seed{seed}"
    if result(out, run.name):
        return
    if not finished(run):
        args, plant, env = job(out, arm, seed, extra)
        # the run's own planted class on resume: trust_run_config
        train_or_resume(run, args, cwd=plant, env=env, trust=True)
    save_result(out, run)


def first_eval_after_fault(run: Path) -> int:
    """The step of the first in-run eval after the fault's update (trainer.eval_every from the run's config)."""
    every = yaml.safe_load((run / ".hydra" / "config.yaml").read_text())["trainer"]["eval_every"]
    return (FAULT_FROM // every + 1) * every


def kill_moment(run: Path, when: str) -> dict | None:
    """Whether now is the moment to kill the run `run` (a dict saying what was seen), else None."""
    if when == "rewind":
        path = run / "guard.jsonl"
        if path.exists() and path.read_text().strip():
            return {"seen": "guard.jsonl's first decision", "decision": read_jsonl(path)[0]}
        return None
    path = run / "metrics.jsonl"
    if not (path.exists() and (run / ".hydra" / "config.yaml").exists()):
        return None
    rows = read_jsonl(path)
    step = first_eval_after_fault(run)
    if not rows or rows[-1]["step"] != step - 1:
        return None
    # time/step_s is the step without its eval: step 20's eval runs from about S to S + E after step 19 is logged
    step_s = statistics.median(r["time/step_s"] for r in rows[-5:])
    eval_s = [r["time/eval_s"] for r in rows if "time/eval_s" in r][-1]
    wait = step_s + eval_s / 4
    if time.time() - path.stat().st_mtime < wait:
        return None
    return {"seen": f"step {step - 1} logged {wait:.1f} s ago (the last 5 steps' median {step_s:.1f} s + a quarter "
                    f"of the last eval's {eval_s:.1f} s)", "step": step, "wait_s": wait}


def passed(run: Path, when: str) -> bool:
    """Whether the run is past the eval it was to be killed in (it logged that step)."""
    path = run / "metrics.jsonl"
    if when != "eval" or not path.exists() or not (run / ".hydra" / "config.yaml").exists():
        return False
    rows = read_jsonl(path)
    return bool(rows) and rows[-1]["step"] >= first_eval_after_fault(run)


def killed(out: Path, seed: int, when: str, extra: list[str]) -> None:
    """The guarded run of `seed` in OUT/runs/killed_WHEN_seedSEED, killed with SIGKILL at `when` (once: its
    OUT/runs/killed_WHEN_seedSEED.kill.json records it), then resumed to its end; its result, with the kill's
    record, in OUT/results/killed_WHEN_seedSEED.json."""
    run = out / "runs" / f"killed_{when}_seed{seed}"
    if result(out, run.name):
        return
    record = run.parent / f"{run.name}.kill.json"
    args, plant, env = job(out, "guarded", seed, extra)
    if not record.exists():
        if run.exists():
            sys.exit(f"{run} exists without {record}: remove it to start the killed run again")
        run.parent.mkdir(parents=True, exist_ok=True)
        with (run.parent / f"{run.name}.log").open("a") as log:
            proc = subprocess.Popen([sys.executable, "-m", "grpo_cli.cli", "train", *args, f"hydra.run.dir={run}"],
                                    cwd=plant, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            seen = None
            while proc.poll() is None and seen is None and not passed(run, when):
                time.sleep(0.2)
                seen = kill_moment(run, when)
            with contextlib.suppress(ProcessLookupError):  # a run that ended on its own has no group left
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if seen is None:
            sys.exit(f"{run.name}: the run went past the moment to kill it ({when}) or ended; remove {run} and run "
                     f"again")
        last = last_checkpoint(run)
        record.write_text(json.dumps({**seen, "killed_at": time.time(), "last_checkpoint": last and last.name},
                                     indent=1))
        print(f"{run.name}: killed ({seen['seen']}); last checkpoint {last and last.name}", flush=True)
    if not finished(run):
        train_or_resume(run, args, cwd=plant, env=env, trust=True)
    save_result(out, run, kill=json.loads(record.read_text()))


def decisions(run: Path) -> list[dict]:
    """guard.jsonl's decisions (no wall-clock field in them: equal runs write equal lines)."""
    path = run / "guard.jsonl"
    return read_jsonl(path) if path.exists() else []


def before_equal(run: dict, whole: dict) -> str:
    """Whether the steps the killed process logged up to its last checkpoint (kept by the resume: one process, no
    kill in them) have the uninterrupted run's loss and reward, exactly: an engine that is not reproducible between
    processes fails here, before any kill could matter. 'False (first at step N)' names the first that differs."""
    upto = int(run["kill"]["last_checkpoint"].split("_")[-1]) if run["kill"].get("last_checkpoint") else 0
    ours = {r["step"]: r for r in run["metrics"] if r["step"] <= upto}
    theirs = {r["step"]: r for r in whole["metrics"] if r["step"] <= upto}
    if not ours or sorted(ours) != sorted(theirs):
        return "–"
    keys = ("loss", "reward")
    differ = [s for s in sorted(ours) if any(ours[s].get(k) != theirs[s].get(k) for k in keys)]
    return f"False (first at step {differ[0]})" if differ else f"True (steps 1-{upto})"


def kill_report(out: Path, seeds: list[int]) -> None:
    print("| seed | killed | seen at the kill | last checkpoint then | steps before it equal | decisions equal | "
          "final checkpoint | adapter equal |\n|---|---|---|---|---|---|---|---|")
    for seed in seeds:
        whole = result(out, f"guarded_seed{seed}")
        for when in ("eval", "rewind"):
            run = result(out, f"killed_{when}_seed{seed}")
            if when == "rewind" and whole and not whole["guard"]:
                print(f"| {seed} | {when} | (the guarded run made no decision: no rewind to kill after) |")
                continue
            if not (whole and run):
                print(f"| {seed} | {when} | (not finished) |")
                continue
            kill = run["kill"]
            if when == "eval":  # by the resumed run's own times for that step: its update, then its eval
                row = next((r for r in run["metrics"] if r["step"] == kill["step"]), None)
                if row is None:  # a later rewind set that step aside: only the times before the kill say it
                    kill["seen"] += (f"; the resumed step {kill['step']} was set aside by a later rewind, so its "
                                     f"own times are not kept")
                else:
                    inside = row["time/step_s"] < kill["wait_s"] < row["time/step_s"] + row["time/eval_s"]
                    kill["seen"] += (f"; the resumed step {kill['step']} took {row['time/step_s']:.1f} s, then its "
                                     f"eval {row['time/eval_s']:.1f} s: the kill fell {'in' if inside else 'outside'} "
                                     f"the eval")
            print(f"| {seed} | {when} | {kill['seen']} | {kill['last_checkpoint']} | {before_equal(run, whole)} | "
                  f"{run['guard'] == whole['guard']} | {run['last_checkpoint']} vs {whole['last_checkpoint']} | "
                  f"{run['adapter_sha256'] == whole['adapter_sha256']} |")


def evals(run: dict) -> dict[int, dict]:
    """The run's in-run evals by step, the last one logged for a step (a rewind redoes steps)."""
    rows = {}
    for r in run["metrics"]:
        if "eval/accuracy" in r:
            rows[r["step"]] = r
    return rows


def end_accuracy(run: dict) -> tuple[int, dict]:
    """(step, eval record) of the checkpoint the run ends at: the one a stop rewound to, else its last step's."""
    step = run["guard"][-1]["rewound_to"] if stops(run["guard"]) else STEPS
    return step, evals(run)[step]


def report(out: Path, seeds: list[int]) -> None:
    print("| seed | B: step 10 | U: unguarded step 40 | G: guarded end (step) | guard decisions | fault hurts | "
          "caught | ends no worse |\n|---|---|---|---|---|---|---|---|")
    tally = [0, 0, 0]
    done = []
    for seed in seeds:
        runs = {arm: result(out, f"{arm}_seed{seed}") for arm in ARMS}
        if not all(runs.values()):
            print(f"| {seed} | (not finished) |")
            continue
        done.append(seed)
        before = evals(runs["unguarded"])[10]
        _, unguarded = end_accuracy(runs["unguarded"])
        g_step, guarded = end_accuracy(runs["guarded"])
        decisions = runs["guarded"]["guard"]
        hurts = (unguarded["eval/accuracy"] < before["eval/accuracy"]
                 and unguarded["eval/accuracy_high"] < before["eval/accuracy_low"])
        caught = bool(decisions)
        no_worse = guarded["eval/accuracy"] >= before["eval/accuracy"]
        tally = [t + int(c) for t, c in zip(tally, (hurts, caught, no_worse))]
        said = "; ".join(f"step {d.get('step')}: {d.get('tripwire')} -> {d.get('remedy')}" for d in decisions)
        print(f"| {seed} | {before['eval/accuracy']:.3f} | {unguarded['eval/accuracy']:.3f} | "
              f"{guarded['eval/accuracy']:.3f} ({g_step}) | {said or 'none'} | {hurts} | {caught} | {no_worse} |")
    if done:
        print(f"of {len(done)} seeds: the fault hurts in {tally[0]}, the guard catches it in {tally[1]}, "
              f"the guarded run ends no worse in {tally[2]}")
        curves(out, done)


def curves(out: Path, seeds: list[int]) -> None:
    """Held-out accuracy against step, a colour a seed: unguarded dashed, guarded solid (the branch it kept); an x
    at each eval that fired the gate (guard.jsonl's values: the abandoned branches' evals), a star where it ends."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    for i, seed in enumerate(seeds):
        colour = f"C{i}"
        for arm, style in (("unguarded", "--"), ("guarded", "-")):
            run = result(out, f"{arm}_seed{seed}")
            kept = sorted(evals(run).items())
            ax.plot([s for s, _ in kept], [r["eval/accuracy"] for _, r in kept], style, color=colour, marker="o",
                    ms=4, label=f"{arm}, seed {seed}")
        guarded = result(out, f"guarded_seed{seed}")
        fired = [d for d in guarded["guard"] if d["tripwire"] == "heldout_drop"]
        ax.plot([d["step"] for d in fired], [d["values"]["accuracy"] for d in fired], "x", color=colour, ms=8)
        step, end = end_accuracy(guarded)
        ax.plot([step], [end["eval/accuracy"]], "*", color=colour, ms=12)
    ax.axvline(FAULT_FROM, color="grey", lw=0.8)
    ax.text(FAULT_FROM + 0.3, 0.98, f"fault from update {FAULT_FROM}", fontsize=7, color="grey", va="top",
            transform=ax.get_xaxis_transform())
    ax.set_xlabel("step (x: an eval that fired the gate, then rewound; *: where the guarded run ends)")
    ax.set_ylabel("held-out accuracy (200 problems)")
    ax.legend(fontsize=7)
    save_figure(fig, out / "curves.png")
    print(f"curves: {out / 'curves.png'}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("run", "report", "kill"))
    ap.add_argument("out", type=Path, nargs="?", default=REPO / "experiments" / "guard")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS), help="run: these arms only")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, extra = ap.parse_args(argv[:cut]), argv[cut + 1:]  # after --: overrides for every run
    out = args.out.resolve()
    if args.what == "kill":
        for seed in args.seeds:
            whole = result(out, f"guarded_seed{seed}")
            if not whole:
                sys.exit(f"the guarded run of seed {seed} is not finished: `guard_check.py run OUT --seeds {seed}`")
            for when in ("eval", "rewind"):
                if when == "rewind" and not whole["guard"]:
                    print(f"seed {seed}: the guarded run made no decision, so there is no rewind to kill after")
                    continue
                killed(out, seed, when, extra)
        with kept(out / "kill.md"):
            kill_report(out, args.seeds)
        return
    if args.what == "run":
        for seed in args.seeds:
            for arm in args.arms:
                train(out, arm, seed, extra)
    with kept(out / "report.md"):  # kept in git beside the results
        report(out, args.seeds)


if __name__ == "__main__":
    main()
