"""Rollouts one step ahead (`algo.max_staleness=1`) against the synchronous loop (0), on the default job sampled by
a vLLM server: what it does to held-out accuracy, and what it saves in time on this 2-core machine.

    .venv/bin/python scripts/async_check.py accuracy [OUT] [--seeds 0 1 2] [--port 8021]   # resumable, hours
    .venv/bin/python scripts/async_check.py overlap [OUT] [--steps 6] [--port 8022]        # 1-2 h, quiet machine
    .venv/bin/python scripts/async_check.py report [OUT]                                   # the tables again

accuracy, the design (fixed before any run):
- arms: algo.max_staleness=0 and =1, each with sampler=vllm_server_short (the server cut at the default job's 32
  tokens; plain vllm_server samples 256, another job) against one `grpo serve` this script starts, the server on
  core 0 and the trainer on core 1 (`taskset`, the placement docs/sampling-vllm.md gives a server on the same
  machine; changed after K=1's first two steps took 5x K=0's with both sharing the cores, before any accuracy); the
  rest is the default job (conf/train.yaml: 40 steps, an eval of the first 200 held-out problems every 10 steps,
  the guard on). The arms of a seed (trainer.seed) draw the same prompts with the same sampling seeds, so they
  differ only in which policy version samples steps 2-40; the two arms of a seed run before the next seed starts.
- the endpoint: held-out greedy accuracy at step 40, the paired difference (K=1 minus K=0) problem by problem
  (RUN/evals/step_000040.jsonl), averaged over problems and seeds; its 95% interval by a two-level bootstrap (the
  seeds, then the problems within each). Steps 10-30 are descriptive, on the same footing.
- the decision, verbatim: "K=1 costs accuracy" if the interval lies wholly below 0; "K=1 is no worse than K=0
  within 5 points" if its lower end is above -0.05; otherwise "undecided at this size" with the interval's width,
  which is the difference the design could have detected.
- staleness: every step of every K=1 run logs sampler/staleness <= 1 (steps 2-40 exactly 1), every K=0 step 0.

overlap: the server pinned to core 0 (`taskset -c 0 grpo serve`), the trainer to core 1 (`taskset -c 1`), the
default job for --steps steps with no eval, K=0 then K=1 then K=0 then K=1 (two rounds, interleaved, one server);
s/step is the median of steps 2..N, the rounds' medians and their ratio side by side. One core each is slow: with
256 new tokens (before the arms took vllm_server_short) the K=0 run's first step took 332 s on 2026-12-06 (rollout
135 s, update 197 s).

Resumable, across sessions (each on a fresh machine): each finished run writes OUT/results/RUN.json (atomically: its
eval rows' correctness and greedy answers, its metrics and guard lines), and the report reads only those. A run with
a result is skipped; one cut short is resumed from its last checkpoint while its folder is still there (the same
session; the product's resume is exact), and started again from step 0 when it is not (a new machine). OUT defaults
to experiments/async/, whose .gitignore keeps results/ and report.md in git (commit each result as it lands); the run
folders (weights, logs) stay out.
A run that stops because the server stopped answering is resumed after the server is started again, at most
RESTARTS times a run; each restart is a line of OUT/results/restarts.jsonl, and the report lists them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path

from paired import REPO, bootstrap, done, kept, read_jsonl, result, train_or_resume, write_json
from server_check import start

STEPS = 40
# the default job's sampling, from the server (32 new tokens, as auto_short); `grpo serve` starts with it too
SAMPLER = "sampler=vllm_server_short"
# both parts (the accuracy arms and the overlap): the server on core 0, the trainer on core 1. Sharing both cores, a
# K=1 step took 263-267 s against K=0's 49-50 s (steps 1-2, seed 0, 2026-12-06; docs/speed.md)
SERVER_CORE, TRAINER_CORE = ("taskset", "-c", "0"), ("taskset", "-c", "1")
EVALS = (10, 20, 30, 40)
RESTARTS = 3  # server restarts one run may have (Server)


def stop(proc: subprocess.Popen | None) -> None:
    if proc is not None:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()


def result_path(run: Path) -> Path:
    return run.parent / "results" / f"{run.name}.json"


def train(run: Path, args: list[str], prefix: tuple[str, ...] = ()) -> None:
    """The run `args` describe in `run`: skipped when its result is written, resumed when it has a checkpoint; its
    result written once its last step is logged."""
    steps = int(next(a for a in args if a.startswith("trainer.max_steps=")).split("=")[1])
    if result_path(run).exists():
        return
    if not done(run, steps):
        t = time.time()
        train_or_resume(run, args, prefix=prefix)
        print(f"{run.name}: {time.time() - t:.0f} s", flush=True)
    save_result(run, args)


def save_result(run: Path, args: list[str]) -> None:
    """OUT/results/RUN.json: what the report reads, small enough for git. Each eval step's rows in the eval's order
    (the first 200 held-out problems, the same in every run): whether the greedy answer is right, and the answer."""
    evals = {}
    for path in sorted((run / "evals").glob("step_*.jsonl")):
        rows = read_jsonl(path)
        evals[str(int(path.stem.split("_")[1]))] = {
            "correct": [bool(r["correct"]) for r in rows], "answer": [r["greedy"]["answer"] for r in rows],
            "question": [r["question"][:60] for r in rows]}
    guard = run / "guard.jsonl"
    saved = {"run": run.name, "args": args, "evals": evals, "metrics": read_jsonl(run / "metrics.jsonl"),
             "guard": read_jsonl(guard) if guard.exists() else []}
    write_json(result_path(run), saved)
    print(f"{run.name}: result in {result_path(run)}", flush=True)


class Server:
    """The experiment's `grpo serve`, started again when a run stops because the server stopped answering (on
    2026-12-06 one did, in k0_seed0's step 12, with nothing in its log; the trainer's timeout ended the run with its
    one line and the run resumes from its last checkpoint). Each restart is a line of OUT/results/restarts.jsonl, and
    the report counts them."""

    def __init__(self, url: str, out: Path, prefix: tuple[str, ...] = ()):
        self.url, self.out, self.prefix = url, out, prefix
        self.proc = start(url, out / "serve.log", prefix=prefix, overrides=(SAMPLER,))

    def train(self, run: Path, args: list[str], prefix: tuple[str, ...] = ()) -> None:
        """`train`, the server started again and the run resumed after each failure, RESTARTS times at most."""
        for attempt in range(RESTARTS + 1):
            try:
                return train(run, args, prefix)
            except SystemExit as err:
                if attempt == RESTARTS:
                    raise
                logged = read_jsonl(run / "metrics.jsonl") if (run / "metrics.jsonl").exists() else []
                line = {"run": run.name, "at": time.time(), "why": str(err),
                        "last_step": logged[-1]["step"] if logged else None}
                (self.out / "results").mkdir(parents=True, exist_ok=True)
                with (self.out / "results" / "restarts.jsonl").open("a") as f:
                    f.write(json.dumps(line) + "\n")
                print(f"{run.name}: {err}; the server is started again and the run resumed", flush=True)
                stop(self.proc)
                self.proc = start(self.url, self.out / "serve.log", prefix=self.prefix, overrides=(SAMPLER,))

    def stop(self) -> None:
        stop(self.proc)


def accuracy(out: Path, seeds: list[int], port: int) -> None:
    server = Server(f"http://127.0.0.1:{port}", out, prefix=SERVER_CORE)
    try:
        for seed in seeds:
            for k in (0, 1):
                server.train(out / f"k{k}_seed{seed}", [f"trainer.max_steps={STEPS}", f"trainer.seed={seed}",
                                                        SAMPLER, f"sampler.url={server.url}",
                                                        f"algo.max_staleness={k}", "trainer.report_to=[]"],
                             prefix=TRAINER_CORE)
    finally:
        server.stop()
    report_accuracy(out)


def report_accuracy(out: Path) -> None:
    found = {p.stem: result(out, p.stem) for p in (out / "results").glob("k*_seed*.json")}  # each file read once
    seeds = sorted({int(name.split("seed")[1]) for name in found})
    paired = [s for s in seeds if f"k0_seed{s}" in found and f"k1_seed{s}" in found]
    runs = {(k, s): found[f"k{k}_seed{s}"] for s in paired for k in (0, 1)}
    print(f"seeds with both arms done: {paired} (of {seeds})")
    print("| step | K=0 accuracy by seed | K=1 accuracy by seed | K=1 - K=0 (paired) | 95% bootstrap |")
    print("|---|---|---|---|---|")
    for step in EVALS:
        acc, diffs = {0: [], 1: []}, {}
        for s in paired:
            rows = [runs[k, s]["evals"][str(step)] for k in (0, 1)]
            # paired problem by problem: the same held-out problems in the same order in both arms
            assert rows[0]["question"] == rows[1]["question"]
            a, b = ([float(c) for c in r["correct"]] for r in rows)
            acc[0].append(statistics.mean(a))
            acc[1].append(statistics.mean(b))
            diffs[s] = [y - x for x, y in zip(a, b)]
        if not diffs:
            continue
        mean = statistics.mean(statistics.mean(d) for d in diffs.values())
        low, high, _ = bootstrap(diffs, 4000)
        print(f"| {step} | {', '.join(f'{v:.3f}' for v in acc[0])} | {', '.join(f'{v:.3f}' for v in acc[1])} | "
              f"{mean:+.3f} | {low:+.3f} to {high:+.3f} |")
        if step == EVALS[-1]:
            verdict = ("K=1 costs accuracy" if high < 0 else "K=1 is no worse than K=0 within 5 points"
                       if low > -0.05 else f"undecided at this size (interval width {high - low:.3f})")
            print(f"decision (step {step}): {verdict}")
    for k in (0, 1):
        seen = [r.get("sampler/staleness", 0) for s in paired for r in runs[k, s]["metrics"] if "step" in r]
        if seen:
            print(f"K={k}: sampler/staleness max {max(seen)}, steps at 1: {sum(v == 1 for v in seen)} of {len(seen)}")
    for s in paired:
        for k in (0, 1):
            print(f"K={k} seed {s}: guard events {len(runs[k, s]['guard'])}, "
                  f"median s/step {step_seconds(runs[k, s]['metrics']):.1f}")


def step_seconds(metrics: list[dict]) -> float:
    """The median time/step_s of steps 2..N (step 1 starts the engine's caches)."""
    return statistics.median(r["time/step_s"] for r in metrics if r.get("step", 0) >= 2 and "time/step_s" in r)


def overlap(out: Path, steps: int, port: int) -> None:
    server = Server(f"http://127.0.0.1:{port}", out, prefix=SERVER_CORE)
    try:
        for round_ in (1, 2):
            for k in (0, 1):
                server.train(out / f"overlap_k{k}_round{round_}",
                             [f"trainer.max_steps={steps}", "trainer.eval_every=null", SAMPLER,
                              f"sampler.url={server.url}", f"algo.max_staleness={k}", "trainer.report_to=[]"],
                             prefix=TRAINER_CORE)
    finally:
        server.stop()
    report_overlap(out)


def report_restarts(out: Path) -> None:
    path = out / "results" / "restarts.jsonl"
    for r in read_jsonl(path) if path.exists() else []:
        print(f"server restarted: {r['run']} stopped after step {r['last_step']} ({r['why']})")


def report_overlap(out: Path) -> None:
    print("| round | K=0 s/step | K=1 s/step | K=1 / K=0 | K=0 rollout s | K=0 update s |\n|---|---|---|---|---|---|")
    for round_ in (1, 2):
        runs = [result(out, f"overlap_k{k}_round{round_}") for k in (0, 1)]
        if not all(runs):
            continue
        sync, ahead = (step_seconds(r["metrics"]) for r in runs)
        rows = [r for r in runs[0]["metrics"] if r.get("step", 0) >= 2 and "time/rollout_s" in r]
        rollout = statistics.median(r["time/rollout_s"] for r in rows)
        update = statistics.median(r["time/update_s"] for r in rows)
        print(f"| {round_} | {sync:.1f} | {ahead:.1f} | {ahead / sync:.2f} | {rollout:.1f} | {update:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=("accuracy", "overlap", "report"))
    parser.add_argument("out", type=Path, nargs="?", default=REPO / "experiments" / "async")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--port", type=int, default=None)
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.what == "report":
        with kept(out / "report.md"):  # kept in git beside the results
            report_accuracy(out)
            report_overlap(out)
            report_restarts(out)
        return
    if args.what == "accuracy":
        accuracy(out, args.seeds, args.port or 8021)
    else:
        overlap(out, args.steps, args.port or 8022)
    report_restarts(out)


if __name__ == "__main__":
    main()
