"""A worker process of its own for user code: forked at its first call (or at `start()`), called over a pipe, killed
and forked again when a call passes its timeout. Reward functions run in one each (`reward.worker=process`,
grpo_cli.rewards.guard), and the tools of `env=tools` in one per environment (grpo_cli.env.tools).

Why a process rather than a thread of this one:
- math_verify (the parse/verify of TRL's and open-r1's rewards) times itself with signal.alarm, which works only
  on a process's main thread; the worker runs the function on its own main thread, so such a reward runs unchanged;
- a hung call is ended with its process: the next call gets a fresh worker, and nothing abandoned keeps holding
  the CPU or the GIL (a thread cannot be killed, and one looping forever slows every later step);
- a function that ends its process (os._exit, a crash of the interpreter) ends its worker, not the run;
- the worker gets copies of the inputs (pickled), so a function that changes them changes nothing another sees.

Forked, not spawned: the function itself is never pickled (a lambda, a module run from a file, a partial of
grpo_cli's), and a start costs a fork of this process, not a new interpreter. A call costs one pickled round trip
of its arguments and its answer. (Pickle only on this pipe, between the trainer and the child it forked itself,
running code the user chose: nothing pickled is written to a file or read from one, so the project's "no pickle"
promise about saved files holds.) What a worker cannot take: arguments that do not pickle (an environment object)
or this process's own objects (a reward model on the GPU); those stay in this process (`reward.worker=thread`, the
reward models, the methods of `env=class`). Where the platform cannot fork, they run in threads.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import multiprocessing
import os
import pickle
import signal
import sys
import time
import warnings
import weakref
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any


def available() -> bool:
    """Whether this platform can fork a worker (not on Windows)."""
    return "fork" in multiprocessing.get_all_start_methods()


class WorkerDied(Exception):
    """The worker process ended during a call (the function called os._exit, or crashed the interpreter)."""


class NotSendable(Exception):
    """A call's arguments do not pickle, so they cannot reach the worker (nothing was sent)."""


class Worker:
    """`work(*args)` run in a child process of its own; one call at a time. `kind` names its process (`ps`, `top`):
    `{kind}-{name}`."""

    def __init__(self, name: str, work: Callable[..., Any], kind: str = "reward"):
        self.name, self.work, self.kind = name, work, kind
        self._process: Any = None
        self._conn: Any = None
        self._stop: weakref.finalize | None = None
        self._calls = 0  # each call's number, which its answer carries back

    def start(self) -> None:
        """Fork the worker now, if it is not running (a call starts it otherwise)."""
        if self._process is None or not self._process.is_alive():
            self.stop()
            self._start()

    def _start(self) -> None:
        context = multiprocessing.get_context("fork")
        ours, theirs = context.Pipe()
        process = context.Process(target=_serve, args=(self.work, theirs, ours, os.getpid()), daemon=True,
                                  name=f"{self.kind}-{self.name}")
        with warnings.catch_warnings():
            # Python 3.12+ warns at every fork of a process with threads (torch's, the trainer's): on the console at
            # every start, about a child that runs the reward function alone (torch held to one thread there)
            warnings.filterwarnings("ignore", message=r".*multi-threaded.*fork", category=DeprecationWarning)
            process.start()
        theirs.close()
        self._process, self._conn = process, ours
        # the worker ends with this object, or at exit
        self._stop = weakref.finalize(self, _kill, process, ours, os.getpid())

    def stop(self) -> None:
        if self._stop is not None:
            self._stop()
        self._process = self._conn = self._stop = None

    def call(self, args: tuple, timeout_s: float | None) -> Any:
        """`work(*args)` in the worker. TimeoutError after `timeout_s` seconds (None: no bound): the worker is killed
        and the next call starts another. WorkerDied when it ended during the call, saying how ("exit code 3",
        "killed by signal SIGSEGV"); NotSendable when `args` do not pickle. An exception `work` raised is raised
        here."""
        self.start()
        self._calls += 1
        try:
            # pickled whole before anything is written: a failure leaves the pipe clean
            self._conn.send((self._calls, args))
        except (pickle.PicklingError, TypeError, AttributeError) as err:
            raise NotSendable(str(err)) from None
        try:
            reply = self._answer(self._calls, None if timeout_s is None else time.monotonic() + timeout_s)
        except (EOFError, OSError):
            how = self._ended()
            self.stop()
            raise WorkerDied(how) from None
        except KeyboardInterrupt:  # Ctrl-C while waiting: the call is abandoned with its worker
            self.stop()
            raise
        if reply is None:
            self.stop()
            raise TimeoutError(f"no answer within {timeout_s} s")
        status, value = reply
        if status == "raise":
            raise value
        return value

    def _answer(self, number: int, deadline: float | None) -> tuple[str, Any] | None:
        """(status, value) of call `number`, or None at `deadline`. An answer carrying another number is not this
        call's (the worker answers only the call it was given, so none should come): it is dropped, never taken for
        this one."""
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._conn.poll(left):
                return None
            answered, status, value = self._conn.recv()
            if answered == number:
                return status, value

    def _ended(self) -> str:
        """How the worker ended: its exit code, or the signal that killed it."""
        code = _reap(self._process, 1.0)
        if code is None:  # still running, its end of the pipe closed (the function closed the descriptor)
            return "it closed its end of the pipe and was stopped"
        if code < 0:
            try:
                return f"killed by signal {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"


def unsendable(value: Any) -> str | None:
    """Why `value` cannot be sent to a worker (pickled as the pipe pickles it), or None when it can."""
    try:
        ForkingPickler.dumps(value)
    except Exception as err:  # TypeError ("cannot pickle '_io.TextIOWrapper' object"), PicklingError, a __reduce__'s
        return f"{type(err).__name__}: {err}"
    return None


def _kill(process, conn, owner: int) -> None:
    if os.getpid() != owner:  # a copy of this object in another worker: not its child
        return
    conn.close()
    if process.is_alive():
        process.kill()  # SIGKILL: the function may ignore or catch anything milder
    _reap(process, 5.0)


def _reap(process, seconds: float) -> int | None:
    """The exit code of a worker that ended (negative: the signal that killed it), once it is reaped (until then it
    reads None), waiting up to `seconds`. By waitpid, not join(): join waits on a pipe that a child the function
    forked may still hold open."""
    deadline = time.monotonic() + seconds
    while process.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.005)
    return process.exitcode


def _die_with_parent(parent: int) -> None:
    """Linux: the kernel kills this worker when the process that forked it dies, even by kill -9, so no worker
    outlives a run (holding its files, its lock, a CPU)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # it died before prctl took effect
        os._exit(0)


def _serve(work: Callable[..., Any], conn, parent_end, parent: int) -> None:
    """The worker's loop: receive (number, arguments), answer (number, "ok", result) or (number, "raise", exception);
    end at EOF."""
    parent_end.close()
    worker = os.getpid()
    # a process the function forks gets no copy of the pipe: it cannot answer on it, nor hold it open once the worker
    # has died (the caller would then wait out the timeout for an end of file that never comes)
    os.register_at_fork(after_in_child=conn.close)
    # Ctrl-C is the trainer's to handle (it ends this worker); SIGTERM, whose handler the trainer installed before
    # the fork, ends the worker at once
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _die_with_parent(parent)
    torch = sys.modules.get("torch")
    if torch is not None:  # OpenMP's thread pool does not survive a fork: one thread for whatever torch work runs here
        torch.set_num_threads(1)
    while True:
        try:
            number, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply = (number, "ok", work(*args))
        except BaseException as err:  # handed to the caller
            reply = (number, "raise", err)
        if os.getpid() != worker:  # a child the function forked, returning from it: only the worker answers
            os._exit(0)
        try:
            conn.send(reply)
        except Exception as err:  # an exception or result that does not pickle
            conn.send((number, "raise", RuntimeError(f"{type(err).__name__} sending the result back: {err}")))
