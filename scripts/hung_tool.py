"""Does a tool that hangs cost the rest of the run? The calculator example's job with its tool as it is, against
the same job whose calculator spins forever (`while True: pass`, a core held) on one call in step 3.

    .venv/bin/python scripts/hung_tool.py run OUT [--steps 8] [--rounds 2] [--arms plain hung]   # quiet machine
    .venv/bin/python scripts/hung_tool.py report OUT

The design (fixed before any run):
- the job: examples/calculator's `--demo turn` training (one demonstrated call before every question: about 0.6
  calls an episode, most of them malformed, so few reach the tool; env=tools, env.max_turns=3,
  env.max_episode_tokens=160, 2 prompts x 8 a step, sampler=auto), trainer.seed=0, --steps steps, no checkpoints
  but the last.
- arms: `plain`, the example's calculator; `hung`, the same function in OUT/tools/hung_calculator.py, which counts
  its calls in a file and on call HANG_AT (in step 3: most of the model's calls are malformed and never reach
  the tool; at trainer.seed=0 steps 1-2 make 4 that do) writes the time to OUT/ARM_rROUND/hang_started and spins
  forever. Under env=tools the call runs in the tools' worker process, which
  the timeout (env.tool_timeout_s, 10 s) kills; the next call gets a new worker. `thread` (a control, not in the
  default arms): the same spinning calculator as a method of an environment class (env=class), whose calls run
  in a thread of the trainer: a thread cannot be killed, and at the timeout an exception is raised in it. Before
  that exception was raised (2026-12-06) the thread spun on: in a 3-step check its hang's step had not ended 460 s
  after the hang began, against 94 s for the plain arm's step 3, so the measurement can see a hang left running.
  Calls of a method that does not stop get an error at once, so a thread run's episodes may differ from the
  others': read it beside the pair, not paired with it.
- rounds: the arms in turn, `--rounds` times (plain, hung, plain, hung), so that the machine's drift falls on both.
- measured: each step's time/step_s (metrics.jsonl); the hang's step (the steps logged when hang_started was
  written, plus one); and, every 0.5 s while the run lasts, the trainer's descendant processes and how many of
  them (and of the trainer's own threads' share, as the trainer's CPU%) use the CPU.
- beside the claim (added after the first plain run, whose step times fell from 99 s to 62 s as its episodes got
  shorter: a hung arm whose training drifts from the plain arm's after the hang changes its step times for that
  reason too): the sampled tokens per second of the rollouts (tokens_per_s) over the same steps, against plain's.
- the claim, verbatim: "a hung sync tool leaves the later steps' speed as it was" holds if, in every round, the
  hung arm's mean step time over the steps after the hang's step is within 10% of the plain arm's over the same
  steps, and after the hang's step no descendant process of the hung arm's trainer stays busy (> 50% of a core
  in more than 2 samples) and the count of descendants returns to the plain arm's.

Each (arm, round) is skipped when its folder has all its steps; a cut one starts again from step 0 (short runs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
from paired import REPO, read_jsonl

CALCULATOR = REPO / "examples" / "calculator"
sys.path.insert(0, str(CALCULATOR))
from run import turns_data  # noqa: E402  (the example's data with its demonstrated turn)

HANG_AT = 5  # the call that hangs: at trainer.seed=0, steps 1-2 make 4 calls that reach the tool (2026-12-06)
BUSY = 50.0  # % of one core: a process above it in a sample is busy

HUNG_TOOL = '''"""The calculator example's tool, except that call {hang_at} of the run (counted in a file beside this
one) spins forever, holding a core, after writing the time to $HANG_MARKER."""

import fcntl
import importlib.util
import os
import time
from pathlib import Path

_spec = importlib.util.spec_from_file_location("_calculator", {calculator!r})
_calc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_calc)


def _count() -> int:
    with open(os.environ["HANG_COUNTER"], "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write("x")
        f.flush()
        return os.path.getsize(os.environ["HANG_COUNTER"])


def _maybe_hang() -> None:
    if _count() == {hang_at}:
        Path(os.environ["HANG_MARKER"]).write_text(str(time.time()))
        while True:
            pass


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: numbers with + - * / and brackets, for example "347 * 28"
    """
    _maybe_hang()
    return _calc.calculator(expression)


class Calculator:
    """The same tool as a method of an environment class (env=class): its calls run in threads of the trainer."""

    def reset(self, **row):
        return None

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression and return its value.

        Args:
            expression: numbers with + - * / and brackets, for example "347 * 28"
        """
        _maybe_hang()
        return _calc.calculator(expression)
'''


def write_tool(out: Path, hang_at: int) -> Path:
    folder = out / "tools"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "hung_calculator.py"
    path.write_text(HUNG_TOOL.format(hang_at=hang_at, calculator=str(CALCULATOR / "calculator.py")))
    return path


def args_for(arm: str, out: Path, steps: int) -> list[str]:
    data = turns_data(out, "turn")
    common = ["data=hf", f"data.path={data}", "reward=custom", "reward.funcs=[answer_reward.correct]",
              "sampler=auto", f"trainer.max_steps={steps}", f"trainer.save_every={steps}", "trainer.eval_every=null",
              "trainer.prompts_per_step=2", "algo.group_size=8", "trainer.report_to=[]", "trainer.seed=0",
              "env.max_turns=3", "env.max_episode_tokens=160"]
    tool = out / "tools" / "hung_calculator.py"
    if arm == "plain":
        return [*common, "env=tools", "env.tools=[calculator.calculator]"]
    if arm == "hung":
        return [*common, "env=tools", f"env.tools=[{tool}:calculator]"]
    if arm == "thread":
        return [*common, "env=class", f"env.factory={tool}:Calculator"]
    raise SystemExit(f"unknown arm {arm}")


def steps_logged(run: Path) -> int:
    path = run / "metrics.jsonl"
    return sum(1 for line in path.read_text().splitlines() if line.strip()) if path.exists() else 0


def watch(pid: int, run: Path, samples: list[dict], stop: threading.Event) -> None:
    """Every 0.5 s: the trainer's descendants, each one's CPU% and the trainer's own, and the steps logged."""
    known: dict[int, psutil.Process] = {}
    try:
        trainer = psutil.Process(pid)
        trainer.cpu_percent(None)
    except psutil.NoSuchProcess:
        return
    while not stop.wait(0.5):
        try:
            kids = trainer.children(recursive=True)
            own = trainer.cpu_percent(None)
        except psutil.NoSuchProcess:
            return
        busy = []
        for kid in kids:
            proc = known.setdefault(kid.pid, kid)
            try:
                cpu = proc.cpu_percent(None)
                busy.append((kid.pid, proc.name(), cpu))
            except psutil.NoSuchProcess:
                pass
        samples.append({"t": time.time(), "steps": steps_logged(run), "trainer_cpu": own,
                        "children": len(kids), "busy": [b for b in busy if b[2] > BUSY]})


def run_one(out: Path, arm: str, round_: int, steps: int) -> None:
    run = out / f"{arm}_r{round_}"
    if steps_logged(run) >= steps and (run / "procs.jsonl").exists():
        return
    shutil.rmtree(run, ignore_errors=True)
    run.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HANG_COUNTER": str(out / f"{arm}_r{round_}.calls"),
           "HANG_MARKER": str(run / "hang_started")}
    Path(env["HANG_COUNTER"]).unlink(missing_ok=True)
    samples: list[dict] = []
    stop = threading.Event()
    start = time.time()
    with (out / f"{arm}_r{round_}.log").open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "grpo_cli.cli", "train", *args_for(arm, out, steps),
                                 f"hydra.run.dir={run}"], cwd=CALCULATOR, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
        watcher = threading.Thread(target=watch, args=(proc.pid, run, samples, stop), daemon=True)
        watcher.start()
        code = proc.wait()
        stop.set()
        watcher.join()
    if code:
        sys.exit(f"{arm} round {round_} failed ({code}): {out / f'{arm}_r{round_}.log'}")
    (run / "procs.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    print(f"{run.name}: {time.time() - start:.0f} s", flush=True)


def summary(run: Path) -> dict:
    """The step times, the hang's step, and the process counts before and after it."""
    records = read_jsonl(run / "metrics.jsonl")
    steps = {r["step"]: r["time/step_s"] for r in records}
    speed = {r["step"]: r["tokens_per_s"] for r in records if "tokens_per_s" in r}
    samples = read_jsonl(run / "procs.jsonl")
    marker = run / "hang_started"
    hang_step = None
    if marker.exists():
        at = float(marker.read_text())
        before = [s for s in samples if s["t"] <= at]
        hang_step = (before[-1]["steps"] if before else 0) + 1
    return {"steps": steps, "speed": speed, "hang_step": hang_step, "samples": samples}


def after(samples: list[dict], step: int) -> list[dict]:
    """The samples taken once steps 1..`step` were logged (the hang's step over)."""
    return [s for s in samples if s["steps"] >= step]


def report(out: Path) -> str:
    runs = {p.name: summary(p) for p in sorted(out.glob("*_r*")) if p.is_dir() and (p / "procs.jsonl").exists()}
    hang_steps = [r["hang_step"] for r in runs.values() if r["hang_step"]]
    if not hang_steps:
        return "no hung run has hung yet"
    hang = max(hang_steps)
    lines = [f"hang in step {sorted(set(hang_steps))} (the step in which the spinning call began); "
             f"steps compared: {hang + 1} on", "",
             "| run | steps 1-2 mean s | hang's step s | later steps mean s | vs plain, same round | descendants "
             "(median before the hang / after it; max) | busy descendants after the hang (samples) | trainer CPU% "
             "after the hang (median) | later steps' sampled tokens/s, vs plain |", "|---" * 9 + "|"]
    verdicts = []
    for name, r in runs.items():
        arm, round_ = name.rsplit("_r", 1)
        later = [t for s, t in r["steps"].items() if s > hang]
        plain = runs.get(f"plain_r{round_}")
        plain_later = [t for s, t in plain["steps"].items() if s > hang] if plain else None
        ratio = statistics.mean(later) / statistics.mean(plain_later) if plain_later else None
        samples = r["samples"]
        before = [s["children"] for s in samples if s["steps"] < hang - 1] or [0]
        later_samples = after(samples, hang)
        late = [s["children"] for s in later_samples] or [0]
        busy = sum(1 for s in later_samples if s["busy"])
        cpu = statistics.median([s["trainer_cpu"] for s in later_samples]) if later_samples else float("nan")
        speed = [v for s, v in r["speed"].items() if s > hang]
        plain_speed = [v for s, v in plain["speed"].items() if s > hang] if plain else []
        tokens = (f"{statistics.mean(speed):.1f}, {statistics.mean(speed) / statistics.mean(plain_speed):.3f}"
                  if speed and plain_speed else "")
        lines.append(f"| {name} | {statistics.mean([r['steps'][1], r['steps'][2]]):.1f} | {r['steps'][hang]:.1f} | "
                     f"{statistics.mean(later):.1f} | {'' if ratio is None else f'{ratio:.3f}'} | "
                     f"{statistics.median(before):.0f} / {statistics.median(late):.0f}; "
                     f"{max(s['children'] for s in samples)} | "
                     f"{busy} | {cpu:.0f} | {tokens} |")
        if arm == "hung" and ratio is not None:
            plain_late = statistics.median([s["children"] for s in after(plain["samples"], hang)] or [0])
            verdicts.append(ratio <= 1.10 and busy <= 2 and statistics.median(late) <= plain_late)
    verdict = (("holds" if verdicts and all(verdicts) else "does not hold")
               + f" ({sum(verdicts)} of {len(verdicts)} rounds within 10%, no busy descendant, descendants back to "
               "the plain arm's)")
    lines += ["", f"claim \"a hung sync tool leaves the later steps' speed as it was\": {verdict}"]
    text = "\n".join(lines) + "\n"
    (out / "report.md").write_text(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", choices=["run", "report"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hang-at", type=int, default=HANG_AT, help="the call that hangs (a smaller one for a check)")
    parser.add_argument("--arms", nargs="+", default=["plain", "hung"], choices=["plain", "hung", "thread"])
    args = parser.parse_args()
    out = args.out.resolve()
    if args.stage == "run":
        out.mkdir(parents=True, exist_ok=True)
        write_tool(out, args.hang_at)
        for round_ in range(1, args.rounds + 1):
            for arm in args.arms:
                run_one(out, arm, round_, args.steps)
    print(report(out))


if __name__ == "__main__":
    main()
