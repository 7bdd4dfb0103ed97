"""Two ranks: gloo processes forked from a fork server (`two_ranks`, and `gloo_rank`, a rank's process group from
start to tear-down), and the installed `grpo` under torchrun."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from grpo_cli.distributed import World, destroy_groups
from tests.helpers.runs import DIGIT_REWARD


def rendezvous() -> str:
    """A TCP rendezvous on a free local port (a FileStore rendezvous aborted a rank at exit once in CI)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def two_ranks(target, out: Path) -> None:
    """Run target(rank, 2, rendezvous, out) in 2 fresh processes; both must exit 0.

    Forked from a fork server that imported torch, transformers, peft and the train command once per test process
    (spawn imported them in each rank: ~6 s of CPU a rank, each time): a rank starts as a fresh interpreter does,
    no thread, CUDA context or process group of the test process in it; its target's module is imported in it, and
    its environment is the test process's at this call (as spawn's), though the modules the fork server imported
    read theirs at its start (conftest's setup_process sets it before any two_ranks call)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "transformers", "peft", "grpo_cli.commands.train", "tests.helpers.ranks"])
    where = rendezvous()
    procs = [ctx.Process(target=_in_environment, args=(dict(os.environ), target, r, 2, where, str(out)))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    # exit codes: -6 is an abort (SIGABRT), None a rank still running after 300 s
    assert [p.exitcode for p in procs] == [0, 0], f"a rank failed or hung: exit codes {[p.exitcode for p in procs]}"


def _in_environment(environ: dict[str, str], target, *args) -> None:
    """A rank of `two_ranks`: `target(*args)` under the environment the test process had at the call."""
    os.environ.clear()
    os.environ.update(environ)
    target(*args)


@contextlib.contextmanager
def gloo_rank(rank: int, size: int, init_method: str):
    """A rank of `two_ranks` in its gloo group, one CPU thread; yields its World. Both ranks leave together: a rank
    that tears the group down while the other is still in it can make gloo abort the other (seen once: exit -6,
    "terminate called without an active exception"); `destroy_groups` ends the group's threads too (FSDP holds it)."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size)
    try:
        yield World(rank, size, rank)
    finally:
        torch.distributed.barrier()
        destroy_groups()


def group_threads() -> list[str]:
    """This process's threads that belong to a process group (gloo's loops, the TCP store's), by their OS names."""
    tasks = Path("/proc/self/task")
    names = [(t / "comm").read_text().strip() for t in tasks.iterdir()] if tasks.exists() else []
    return sorted(n for n in names if n.startswith(("gloo", "pt_gloo", "pt_tcpstore")))


TORCHRUN_TINY = ["model=tiny", "sampler.max_new_tokens=8", "algo.group_size=4", "trainer.prompts_per_step=4",
                 "trainer.micro_batch_size=4", "optimizer.lr=0.05", "trainer.warmup_steps=0", "trainer.report_to=[]",
                 "trainer.max_steps=3", "trainer.save_every=1", "trainer.log_completions_every=1",
                 "trainer.num_completions_to_print=0", "trainer.eval_every=null", DIGIT_REWARD,
                 "+reward.weights.digit=1.0"]


def torchrun(cwd: Path, *args: str, ranks: int = 2) -> subprocess.CompletedProcess:
    """The installed `grpo` under `torchrun --nproc-per-node=RANKS` (plain `grpo` for 1 rank); must exit 0."""
    bin_dir = Path(sys.executable).parent
    launch = ([str(bin_dir / "torchrun"), "--standalone", f"--nproc-per-node={ranks}", str(bin_dir / "grpo")]
              if ranks > 1 else [str(bin_dir / "grpo")])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*launch, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


# ---- vLLM beside HF generate (the sampler's tests and the 4-bit base's) ---------------------------------------------
