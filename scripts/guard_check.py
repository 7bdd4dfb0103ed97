"""The guard against a planted fault on the default job: does it catch a learning rate gone 30x too high, and does
the run end no worse than it was before the fault?

    .venv/bin/python scripts/guard_check.py run OUT [--seeds 0 1 2]   # 2 arms x 3 seeds of the default job, resumable
    .venv/bin/python scripts/guard_check.py report OUT                # the table and OUT/curves.png again

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

Each run is skipped when its last step is logged (or, guarded, when its guard.jsonl ends in a stop) and resumed
from its last checkpoint when it was cut short, so a stopped script goes on where it stopped when run again.
`-- OVERRIDES` adds overrides to every run (`run /tmp/gc -- model=tiny sampler.max_new_tokens=8` checks the
plumbing in minutes).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from paired import REPO, done, read_jsonl, save_figure, train_or_resume

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


def stopped(run: Path) -> bool:
    path = run / "guard.jsonl"
    return path.exists() and any(d["remedy"] == "stop" for d in read_jsonl(path))


def finished(run: Path) -> bool:
    return done(run, STEPS) or stopped(run)


def train(out: Path, arm: str, seed: int, extra: list[str]) -> None:
    run = out / "runs" / f"{arm}_seed{seed}"
    if finished(run):
        return
    plant = out / "plant"
    plant.mkdir(parents=True, exist_ok=True)
    (plant / "spiked.py").write_text(SPIKED)
    args = [f"trainer.max_steps={STEPS}", f"trainer.seed={seed}", "trainer.report_to=[]",
            "optimizer._target_=spiked.SpikedAdamW", f"+optimizer.spike_from={FAULT_FROM}",
            f"+optimizer.factor={FACTOR}", *ARMS[arm], *extra]
    # grpo_cli from this checkout, spiked.py from the working folder; the run's own planted class on resume
    train_or_resume(run, args, cwd=plant, env={**os.environ, "PYTHONPATH": str(REPO)}, trust=True)


def evals(run: Path) -> dict[int, dict]:
    """The run's in-run evals by step, the last one logged for a step (a rewind redoes steps)."""
    rows = {}
    for r in read_jsonl(run / "metrics.jsonl"):
        if "eval/accuracy" in r:
            rows[r["step"]] = r
    return rows


def end_accuracy(run: Path) -> tuple[int, dict]:
    """(step, eval record) of the checkpoint the run ends at: the one a stop rewound to, else its last step's."""
    step = read_jsonl(run / "guard.jsonl")[-1]["rewound_to"] if stopped(run) else STEPS
    return step, evals(run)[step]


def report(out: Path, seeds: list[int]) -> None:
    print("| seed | B: step 10 | U: unguarded step 40 | G: guarded end (step) | guard decisions | fault hurts | "
          "caught | ends no worse |\n|---|---|---|---|---|---|---|---|")
    tally = [0, 0, 0]
    done = []
    for seed in seeds:
        runs = {arm: out / "runs" / f"{arm}_seed{seed}" for arm in ARMS}
        if not all(finished(r) for r in runs.values()):
            print(f"| {seed} | (not finished) |")
            continue
        done.append(seed)
        before = evals(runs["unguarded"])[10]
        _, unguarded = end_accuracy(runs["unguarded"])
        g_step, guarded = end_accuracy(runs["guarded"])
        decisions = read_jsonl(runs["guarded"] / "guard.jsonl") if (runs["guarded"] / "guard.jsonl").exists() else []
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
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    for seed in seeds:
        for arm, style in (("unguarded", "--"), ("guarded", "-")):
            rows = read_jsonl(out / "runs" / f"{arm}_seed{seed}" / "metrics.jsonl")
            points = [(i, r["eval/accuracy"]) for i, r in enumerate(rows) if "eval/accuracy" in r]
            ax.plot([rows[i]["step"] for i, _ in points], [a for _, a in points], style, marker="o",
                    label=f"{arm}, seed {seed}")
    ax.axvline(FAULT_FROM, color="grey", lw=0.8)
    ax.set_xlabel("step (a rewind goes back)")
    ax.set_ylabel("held-out accuracy")
    ax.legend(fontsize=7)
    save_figure(fig, out / "curves.png")
    print(f"curves: {out / 'curves.png'}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("run", "report"))
    ap.add_argument("out", type=Path)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, extra = ap.parse_args(argv[:cut]), argv[cut + 1:]  # after --: overrides for every run
    out = args.out.resolve()
    if args.what == "run":
        for seed in args.seeds:
            for arm in ARMS:
                train(out, arm, seed, extra)
    report(out, args.seeds)


if __name__ == "__main__":
    main()
