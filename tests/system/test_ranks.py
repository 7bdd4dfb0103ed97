"""A rank killed with `kill -9`: the other ranks end with one line naming it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def _dying_worker(rank: int, port: int, out: str) -> None:
    import os
    import signal
    import time

    from grpo_cli.distributed import init_world
    from grpo_cli.errors import RunError

    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    world = init_world()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # as `kill -9` of one torchrun rank
    time.sleep(1)
    try:
        world.sum(torch.tensor([1.0]))
    except RunError as err:
        Path(out, "rank0.txt").write_text(str(err))
    assert init_world() is world  # the broken world stays this process's: no new group is joined


@pytest.mark.slow  # kill -9 of a rank process (~7 s): make test-ci
@pytest.mark.ci
def test_a_killed_rank_ends_the_others_with_one_line_naming_it(tmp_path):
    import multiprocessing
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_dying_worker, args=(r, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, -9]
    line = (tmp_path / "rank0.txt").read_text()
    assert "\n" not in line and line.startswith(f"rank 1 (pid {procs[1].pid}) stopped (killed or crashed), so "
                                                f"rank 0 cannot go on (")
    assert line.endswith("resume the run with grpo train resume=RUN")
