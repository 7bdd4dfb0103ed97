"""Two torchrun ranks sharing one vLLM server, on the embedded SmolLM2: data parallel and FSDP2, each killed (-9) in
the middle and resumed.

    .venv/bin/python scripts/server_ranks.py OUT [--port 8013]

1. `grpo serve` on the port (OUT/serve.log).
2. DP: `torchrun --nproc-per-node 2 grpo train sampler=vllm_server` for 3 steps (a checkpoint every step, every
   completion logged): one run folder, every step's completions from both ranks' prompts.
3. DP killed: the same run; rank 1 alone is killed (-9) once step 1's checkpoint is written (torchrun then stops
   rank 0); `resume=` on 2 ranks. Its metrics against the uninterrupted run's, step by step.
4. FSDP2: the same two runs with trainer.fsdp=true (the base sharded over the ranks, the adapter pushed by rank 0).
The server keeps running throughout: a killed trainer leaves it serving its last complete adapter.
Each run is skipped when its folder holds step 3.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from server_check import REPO, start
from server_faults import gap, steps

BIN = Path(sys.executable).parent
RUN = ["trainer.max_steps=3", "trainer.save_every=1", "trainer.eval_every=null", "sampler=vllm_server",
       "sampler.max_new_tokens=32", "trainer.report_to=[]", "trainer.log_completions_every=1",
       "trainer.num_completions_to_print=0"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # two ranks on two cores


def launch(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", "-m", "grpo_cli.cli",
                             "train", *args], cwd=REPO, env=ENV, stdout=log.open("a"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def parent(pid: str) -> int:
    return int((Path("/proc") / pid / "stat").read_text().rsplit(")", 1)[1].split()[1])


def rank_pid(proc: subprocess.Popen, rank: int) -> int | None:
    """The pid of torchrun's worker with RANK=`rank`: a descendant of `proc` (torchrun starts each worker in a session
    of its own), found by its environment."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            ancestor = parent(entry.name)
            while ancestor > 1 and ancestor != proc.pid:
                ancestor = parent(str(ancestor))
        except (OSError, ValueError, IndexError):
            continue
        if ancestor == proc.pid and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


def uninterrupted(run: Path, extra: list[str]) -> None:
    if (run / "checkpoints" / "step_000003").is_dir():
        return
    code = launch([*RUN, *extra, f"hydra.run.dir={run}"], run.parent / f"{run.name}.log").wait()
    print(f"{run.name}: exit {code}", flush=True)


def killed(run: Path, extra: list[str]) -> None:
    if (run / "checkpoints" / "step_000003").is_dir():
        return
    log = run.parent / f"{run.name}.log"
    if not (run / "checkpoints").is_dir():
        proc = launch([*RUN, *extra, f"hydra.run.dir={run}"], log)
        while not (run / "checkpoints" / "step_000001").is_dir() and proc.poll() is None:
            time.sleep(0.5)
        pid = rank_pid(proc, 1)
        if pid is not None and proc.poll() is None:
            os.kill(pid, signal.SIGKILL)
        code = proc.wait()
        print(f"{run.name}: rank 1 (pid {pid}) killed after step 1's checkpoint; torchrun exit {code}", flush=True)
    code = launch([f"resume={run}"], log).wait()
    print(f"{run.name}: resumed, exit {code}", flush=True)


def both_ranks(run: Path) -> str:
    """How many completions each step logged, and from how many distinct prompts."""
    rows = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    per = {}
    for r in rows:
        per.setdefault(r["step"], set()).add(r["prompt_id"])
    counts = {s: sum(r["step"] == s for r in rows) for s in per}
    return ", ".join(f"step {s}: {counts[s]} completions of {len(p)} prompts" for s, p in sorted(per.items()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--port", type=int, default=8013)
    args = parser.parse_args()
    out, url = args.out.resolve(), f"http://127.0.0.1:{args.port}"
    out.mkdir(parents=True, exist_ok=True)
    server = start(url, out / "serve.log")
    try:
        for name, extra in (("dp", []), ("fsdp", ["trainer.fsdp=true"])):
            extra = [*extra, f"sampler.url={url}"]
            uninterrupted(out / name, extra)
            killed(out / f"{name}_killed", extra)
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    for name in ("dp", "fsdp"):
        a, b = steps(out / name), steps(out / f"{name}_killed")
        print(f"\n{name}: {both_ranks(out / name)}")
        print("| step | uninterrupted | killed (rank 1), resumed: largest relative difference |\n|---|---|---|")
        for x, y in zip(a, b):
            print(f"| {x['step']} | {x} | {gap(x, y)} |")


if __name__ == "__main__":
    main()
