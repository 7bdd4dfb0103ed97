"""A worker process of its own (grpo_cli.workers): how a worker that died is reported, and a function that forks
never answers on the worker's pipe."""

from __future__ import annotations

import multiprocessing
import os
import resource
import signal
import time

import pytest

from grpo_cli import workers
from grpo_cli.rewards import OutcomeReward

pytestmark = pytest.mark.skipif(not workers.available(), reason="no fork on this platform")


def exits(code: int) -> None:
    os._exit(code)


def segfaults() -> None:
    # no core file: where core dumps are on (ulimit -c), the kernel wrote the forked worker's memory, the whole
    # test process's with torch loaded, to disk first (3.5 s of a make test run)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.kill(os.getpid(), signal.SIGSEGV)


@pytest.mark.parametrize("work, args, expected", [
    (exits, (3,), "exit code 3"),
    (segfaults, (), "killed by signal SIGSEGV"),
], ids=["os._exit(3)", "segfault"])
def test_a_worker_that_died_is_reported_with_its_exit_code_or_signal(work, args, expected):
    worker = workers.Worker("dies", work)
    try:
        with pytest.raises(workers.WorkerDied) as died:
            worker.call(args, 10.0)
    finally:
        worker.stop()
    assert str(died.value) == expected


def test_a_worker_that_died_is_named_in_the_rewards_warning(caplog):
    reward = OutcomeReward({"dies": lambda prompts, completions, **_: exits(3)}, weights=None, timeout_s=10.0,
                           worker="process")
    result = reward(["p"], ["x"], {})
    assert result.rewards == [None] and result.failures == 1
    assert "ended its worker process during a call (exit code 3)" in caplog.text


def forks_once(prompts, completions, **_):
    """Call 1 forks a child that returns from the function as the worker does, 0.2 s after the worker's answer: in
    a loop that answered whoever returned, its stale [1.0] would be the next call's scores."""
    if prompts[0] == "first":
        if os.fork() == 0:
            time.sleep(0.2)
            return [-1.0] * len(completions)
        return [1.0] * len(completions)
    return [float(len(prompts[0]))] * len(completions)


def test_a_child_the_function_forked_never_answers_on_the_workers_pipe():
    reward = OutcomeReward({"forks": forks_once}, weights=None, timeout_s=10.0, worker="process")
    assert reward(["first"], ["x"], {}).rewards == [1.0]
    time.sleep(0.5)  # the child has returned from the function by now
    # each call's own scores: len("second") = 6, len("third!!") = 7
    assert reward(["second"], ["x"], {}).rewards == [6.0]
    assert reward(["third!!"], ["x"], {}).rewards == [7.0]


def leaves_a_child_then_exits(call: int) -> str:
    """Call 1 forks a child that lives on for 3 s; call 2 ends the worker with exit code 3."""
    if call == 1:
        if os.fork() == 0:
            time.sleep(3)
        return "forked"
    os._exit(3)


def test_a_child_left_running_does_not_hide_the_workers_death():
    # the child of call 1 is still alive when call 2 kills the worker: were it holding the worker's end of the pipe,
    # the caller would see no end of file and wait out the 2 s timeout instead
    worker = workers.Worker("forks", leaves_a_child_then_exits)
    try:
        assert worker.call((1,), 2.0) == "forked"
        begin = time.monotonic()
        with pytest.raises(workers.WorkerDied, match="exit code 3"):
            worker.call((2,), 2.0)
        assert time.monotonic() - begin < 1.0
    finally:
        worker.stop()


def test_a_call_past_its_timeout_is_a_timeout_not_a_death():
    worker = workers.Worker("sleeps", time.sleep)
    try:
        with pytest.raises(TimeoutError, match="no answer within 0.2 s"):
            worker.call((30,), 0.2)
        assert worker.call((0,), 5.0) is None  # a new worker answers the next call
    finally:
        worker.stop()


def test_an_answer_carrying_another_calls_number_is_dropped():
    # what the caller reads of a pipe holding an answer to call 1 while it waits for call 2's
    worker = workers.Worker("reads", lambda: None)
    ours, theirs = multiprocessing.Pipe()
    worker._conn = ours
    theirs.send((1, "ok", "stale"))
    theirs.send((2, "ok", "fresh"))
    assert worker._answer(2, time.monotonic() + 5) == ("ok", "fresh")
    assert worker._answer(3, time.monotonic() + 0.05) is None  # nothing more: None at the deadline
