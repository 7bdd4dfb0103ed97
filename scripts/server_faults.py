"""A vLLM server killed (-9) in the middle of a run, and the run resumed once it is back, on the embedded SmolLM2.

    .venv/bin/python scripts/server_faults.py OUT [--port 8012]

1. `grpo serve` on the port; no server on it at first: `grpo train sampler=vllm_server` must stop with one line,
   before the model loads, in under 10 s.
2. A and A2: 3 steps each, uninterrupted, one after the other on the same server (trainer.save_every=1, 32 new
   tokens, every completion logged): how far two runs of the same config differ on this machine with no fault.
3. B: the same run; the server is killed (-9) once step 1's checkpoint is written: one `error:` line, exit 1.
4. The server started again; `grpo train resume=B`: B's metrics against A's, next to A2's against A's (vLLM's
   seeded sampling on the same weights and prompts; equality is what it shows, not what it assumes: the table
   lists every step, and whether each step's completions are the same tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from server_check import GRPO, REPO, start

RUN = ["trainer.max_steps=3", "trainer.save_every=1", "trainer.eval_every=null", "sampler=vllm_server",
       "sampler.max_new_tokens=32", "trainer.report_to=[]",
       "trainer.log_completions_every=1", "trainer.num_completions_to_print=0"]


def kill(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)  # the server and its engine process
    proc.wait()


def steps(run: Path) -> list[dict]:
    keys = ("step", "reward", "loss", "kl", "sampler/logp_gap")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [{k: json.loads(line).get(k) for k in keys} for line in lines]


def completions(run: Path) -> dict[int, list[str]]:
    """Each step's completions, in the order the run logged them."""
    by_step: dict[int, list[str]] = {}
    for line in (run / "completions.jsonl").read_text().splitlines():
        row = json.loads(line)
        by_step.setdefault(row["step"], []).append(row["completion"])
    return by_step


def gap(x: dict, y: dict) -> str:
    """The largest relative difference over a step's numbers (0 where they are bitwise equal)."""
    worst = max(abs(x[k] - y[k]) / max(abs(x[k]), 1e-30) for k in x if isinstance(x[k], float))
    return "equal" if x == y else f"{worst:.1e}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--port", type=int, default=8012)
    args = parser.parse_args()
    out, url = args.out.resolve(), f"http://127.0.0.1:{args.port}"
    out.mkdir(parents=True, exist_ok=True)
    train = [*GRPO, "train", *RUN, f"sampler.url={url}"]

    t = time.time()
    done = subprocess.run([*train, f"hydra.run.dir={out / 'refused'}"], cwd=REPO, capture_output=True, text=True)
    print(f"no server: exit {done.returncode} in {time.time() - t:.1f} s: {done.stderr.strip()}")

    server = start(url, out / "serve.log")
    for name in ("A", "A2"):
        subprocess.run([*train, f"hydra.run.dir={out / name}"], cwd=REPO, check=True, capture_output=True)
    b = subprocess.Popen([*train, f"hydra.run.dir={out / 'B'}"], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    while not (out / "B" / "checkpoints" / "step_000001").is_dir():
        time.sleep(1)
    kill(server)
    _, err = b.communicate()
    lines = err.strip().splitlines()
    print(f"server killed after step 1's checkpoint: exit {b.returncode}, {len(lines)} stderr line(s):")
    for line in lines:  # all of them: the console's own lines (the sampler, the run folder) and the error
        print(f"  {line}")
    server = start(url, out / "serve.log")
    try:
        subprocess.run([*GRPO, "train", f"resume={out / 'B'}"], cwd=REPO, check=True, capture_output=True)
    finally:
        kill(server)
    a, again, resumed = (steps(out / n) for n in ("A", "A2", "B"))
    ca, cagain, cresumed = (completions(out / n) for n in ("A", "A2", "B"))
    print("| step | A (uninterrupted) | A2 vs A: largest relative difference, same completions | "
          "B (killed, resumed) vs A | \n|---|---|---|---|")
    for x, y, z in zip(a, again, resumed):
        n = x["step"]
        print(f"| {n} | {x} | {gap(x, y)}, {ca[n] == cagain[n]} | {gap(x, z)}, {ca[n] == cresumed[n]} |")


if __name__ == "__main__":
    main()
