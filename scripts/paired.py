"""What the paired experiment scripts share (process_vs_outcome.py, iterative_vs_fixed.py): running `grpo` in a
subprocess of this interpreter, a run's last checkpoint, JSONL files, the two-level bootstrap of a paired mean and
the t-interval of a mean.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Student's t at 0.975 for 1..30 degrees of freedom (more than 30 use the 30th: a slightly wider interval)
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def t975(df: float) -> float:
    """Student's t at 0.975 for `df` degrees of freedom (its whole part; below 1 reads as 1, above 30 as 30)."""
    return T975[min(max(int(df), 1), len(T975)) - 1]


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


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def done(run: Path, steps: int) -> bool:
    """Whether the run in `run` has logged its step `steps`."""
    path = run / "metrics.jsonl"
    return path.exists() and any(r["step"] == steps for r in read_jsonl(path))


def train_or_resume(run: Path, args: list[str], *, prefix: tuple[str, ...] = (), cwd: Path = REPO,
                    env: dict | None = None, trust: bool = False) -> None:
    """`grpo train ARGS` into the folder `run`, or `grpo train resume=RUN` once it has a checkpoint (a run cut short
    goes on from there), from `cwd` with `env`, after `prefix` (`taskset -c 1`); the output is appended to RUN.log
    beside the folder, and a failure exits naming it. A folder with no checkpoint (cut short before its first) is
    removed and the run starts again from step 0. `trust`: the run's config names the script's own code (a
    user's class), which a resume builds only with trust_run_config=true."""
    if last_checkpoint(run) is None and run.exists():
        # cut short before its first checkpoint: nothing to resume, and grpo train refuses a folder that holds a run
        shutil.rmtree(run)
        print(f"{run.name}: cut short before its first checkpoint; started again from step 0", flush=True)
    resume = ([f"resume={run}", *(["trust_run_config=true"] if trust else [])] if last_checkpoint(run) is not None
              else [*args, f"hydra.run.dir={run}"])
    run.parent.mkdir(parents=True, exist_ok=True)
    log = run.parent / f"{run.name}.log"
    with log.open("a") as out:
        code = subprocess.call([*prefix, sys.executable, "-m", "grpo_cli.cli", "train", *resume], cwd=cwd, env=env,
                               stdout=out, stderr=subprocess.STDOUT)
    if code:
        sys.exit(f"grpo train failed ({code}): {log}")


def bootstrap(diffs: dict[int, list[float]], draws: int, seed: int = 0) -> tuple[float, float, float]:
    """(2.5%, 97.5%, standard error) of the mean over seeds of each seed's mean paired difference, resampling
    the seeds and then the items (prompts, problems) within each seed."""
    rng = random.Random(seed)
    seeds = sorted(diffs)
    means = []
    for _ in range(draws):
        picked = [diffs[rng.choice(seeds)] for _ in seeds]
        means.append(statistics.mean(statistics.mean(rng.choices(d, k=len(d))) for d in picked))
    means.sort()
    return means[int(0.025 * draws)], means[int(0.975 * draws) - 1], statistics.stdev(means)


def t_interval(values: list[float]) -> tuple[float, float, float]:
    """(mean, lower, upper): the 95% t-interval of the mean of `values` (per-seed or per-prompt differences)."""
    n = len(values)
    mean = statistics.mean(values)
    if n < 2:
        return mean, -math.inf, math.inf
    half = t975(n - 1) * statistics.stdev(values) / math.sqrt(n)
    return mean, mean - half, mean + half


@contextlib.contextmanager
def kept(path: Path):
    """What the block prints, printed and also written to `path` (a report kept beside its results)."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        yield
    text = buffer.getvalue()
    print(text, end="")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def write_json(path: Path, data: dict) -> None:
    """Whole or not at all: a kill mid-write leaves no half file that a re-run would take for a finished one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def result(out: Path, name: str) -> dict | None:
    """OUT/results/NAME.json, the finished run a later session goes on from; None while there is none."""
    path = out / "results" / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def finished(out: Path) -> tuple[list[dict], dict | None]:
    """An experiment's finished runs (OUT/results/ARM_sSEED.json, by name) and its starting policy's eval
    (OUT/results/base.json; None until measured)."""
    results = [json.loads(p.read_text()) for p in sorted((out / "results").glob("*_s*.json"))]
    return results, result(out, "base")


def save_figure(fig, path: Path) -> None:
    """Lay out, write (folders made) and close a matplotlib figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
