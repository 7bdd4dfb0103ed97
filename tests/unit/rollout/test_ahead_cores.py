"""The line for rollouts ahead from a server that shares the trainer's CPU cores (rollout/ahead.py `shared_cores`)."""

from __future__ import annotations

import pytest

from grpo_cli.rollout.ahead import shared_cores


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://localhost:8021", "http://0.0.0.0:8000"])
def test_a_server_on_this_machine_and_an_unpinned_cpu_trainer_get_the_line(url):
    line = shared_cores(1, url, "cpu", usable=2, cores=2)
    assert line.startswith("rollouts ahead (algo.max_staleness=1) from a server on this machine, which shares all 2 "
                           "cores with this trainer: pin each to its own (taskset)")


@pytest.mark.parametrize("k,url,device,usable", [
    (0, "http://127.0.0.1:8000", "cpu", 2),        # synchronous: the server is idle while the trainer updates
    (1, "http://10.0.0.5:8000", "cpu", 2),         # the server on another machine
    (1, "http://127.0.0.1:8000", "cuda", 2),       # the trainer computes on a GPU
    (1, "http://127.0.0.1:8000", "cpu", 1),        # the trainer pinned (taskset -c 1): the user placed them
    (1, None, "cpu", 2),                           # no server URL (not a server sampler)
])
def test_no_line_where_nothing_shares_the_cores(k, url, device, usable):
    assert shared_cores(k, url, device, usable=usable, cores=2) is None
