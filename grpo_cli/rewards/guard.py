"""The timeout runner: each reward function runs guarded, so a broken one costs scores, never the run.

`Guarded(name, fn, timeout_s, convert, worker)` calls `fn(prompts, completions, **columns)` with a timeout and
converts its output with `as_scores` (one float or None per completion: an outcome function) or `as_steps` (sorted
`(char_end, reward)` per completion: a step scorer). A function that raises (even SystemExit), hangs or returns
garbage costs its completions their score (None); a call that raised is retried one completion at a time, so only
the completions it fails on lose theirs. A ConfigError (a bad option fails every call) stops the run with the fix,
and KeyboardInterrupt (Ctrl-C) passes through. Each function gets its own copy of the inputs: one that changes
them changes nothing the next one sees.

Where the function runs (`reward.worker`): `process`, a worker process of its own (grpo_cli.workers says why:
math_verify's timeouts work there, and a hung call is killed, so it costs that call only); `thread`, a thread of this
process, for a function given objects that do not pickle or that must share this process's (the reward models). With
`timeout_s` null a thread-mode function runs inline, on the caller's thread.

Not in the paper (DeepSeekMath scores with a reward model it trained itself): a robustness layer for
rule-based and user-written functions.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout  # TimeoutError itself from Python 3.11 on
from typing import Any

from grpo_cli import workers
from grpo_cli.errors import ConfigError

log = logging.getLogger(__name__)

# where a function runs (reward.worker)
WORKERS = ("process", "thread")


def _failed(err: BaseException) -> bool:
    """Whether an exception from a reward function is the function's failure (its completions lose their
    score) rather than the user stopping the run. SystemExit counts as a failure: a library that calls
    sys.exit() on odd input must not end training without a word."""
    return not isinstance(err, (KeyboardInterrupt, ConfigError))


def _fresh(value: Any) -> Any:
    """A copy of the lists, dicts and tuples in `value`; what they hold beyond that (strings, numbers, a column's
    objects) is shared, as TRL shares it."""
    if isinstance(value, list):
        return [_fresh(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_fresh(v) for v in value)
    if isinstance(value, dict):
        return {k: _fresh(v) for k, v in value.items()}
    return value


def attempt(fn: Callable, convert: Callable[[Any, list[str]], list], prompts: list, completions: list[str],
            columns: dict[str, list]) -> tuple[list, str | None]:
    """(one converted result per completion, None where lost; why the batch call failed, or None).

    A batch call that fails is retried one completion at a time. Raises only what `_failed` says is no failure."""
    try:
        return convert(fn(prompts, completions, **columns), completions), None
    except BaseException as err:
        if not _failed(err):  # a bad option (a broken regex, buffer 0) fails every call: stop with the fix
            raise
        why = f"raised {err!r}; fix the function (it is retried one completion at a time)"
    out = []
    for i in range(len(completions)):
        try:
            single = fn(prompts[i:i + 1], completions[i:i + 1], **{k: v[i:i + 1] for k, v in columns.items()})
            out.append(convert(single, completions[i:i + 1])[0])
        except BaseException as err:
            if isinstance(err, KeyboardInterrupt):
                raise
            out.append(None)
    return out, why


class Guarded:
    """One scoring function run with a timeout, in its worker process or in a thread (see the module docstring);
    raises only ConfigError and KeyboardInterrupt.

    In a thread, a timed-out call cannot be killed, so it runs on as a daemon (it does not block interpreter exit),
    and while it still runs the function is not called again: its next calls give None at once instead of piling
    up threads. With timeout_s null in a thread, nothing bounds a hung function: it hangs the step; Ctrl-C (twice
    during training) raises KeyboardInterrupt in it, which passes through.
    """

    def __init__(self, name: str, fn: Callable, timeout_s: float | None,
                 convert: Callable[[Any, list[str]], list], worker: str):
        self.name, self.fn, self.timeout_s, self.convert = name, fn, timeout_s, convert
        work = functools.partial(attempt, fn, convert)
        self._process = workers.Worker(name, work) if worker == "process" and workers.available() else None
        if self._process is not None:
            # forked now, while the command is small (the reward is built before the model loads): a worker forked
            # later shares the trainer's model, engine and heap pages, and every page the trainer then writes is
            # copied first (copy-on-write), which made each training step ~20% slower (docs/rewards.md)
            self._process.start()
        self._thread: threading.Thread | None = None
        self._warned = False

    @property
    def in_process(self) -> bool:
        """Whether the function runs in a worker process, whose arguments must pickle."""
        return self._process is not None

    def _in_thread(self, work: Callable[[], Any]) -> Any:
        if not self.timeout_s:
            return work()
        future: Future = Future()

        def target() -> None:
            future.set_running_or_notify_cancel()
            try:
                future.set_result(work())
            except BaseException as err:  # handed to the caller through the future
                future.set_exception(err)

        self._thread = threading.Thread(target=target, daemon=True, name=f"reward-{self.name}")
        self._thread.start()
        return future.result(timeout=self.timeout_s)

    def _warn(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("reward %r %s; its completions get no score (warned once per function)",
                        self.name, why)

    def __call__(self, prompts: list[str], completions: list[str], columns: dict[str, list]) -> tuple[list, bool]:
        """(one converted result per completion, None where lost; whether the call failed)."""
        n = len(completions)
        if self._thread is not None and self._thread.is_alive():
            self._warn(f"is still running from an earlier call that passed timeout_s={self.timeout_s}")
            return [None] * n, True
        args = (prompts, completions, columns)
        try:
            if self._process is not None:
                try:
                    out, why = self._process.call(args, self.timeout_s)  # the worker gets pickled copies
                except workers.NotSendable as err:
                    raise ConfigError(f"reward function {self.name!r} is given objects that cannot be sent to its "
                                      f"worker process ({err}); set reward.worker=thread to run it in this process"
                                      ) from None
            else:
                out, why = self._in_thread(lambda: attempt(self.fn, self.convert, *_fresh(args)))
        except (TimeoutError, FutureTimeout):
            killed = "; its worker was stopped, the next call gets a new one" if self._process is not None else ""
            self._warn(f"took longer than timeout_s={self.timeout_s} s{killed}; raise reward.timeout_s if it is "
                       f"just slow")
            return [None] * n, True
        except workers.WorkerDied as err:
            self._warn(f"ended its worker process during a call ({err}); fix the function")
            return [None] * n, True
        if why is not None:
            self._warn(why)
        return out, why is not None


def as_scores(out: Any, completions: list[str]) -> list[float | list[float | None] | None]:
    """A reward function's output -> one float or None per completion, or for a multi-turn episode a list of them,
    one per assistant turn (`combine.OutcomeReward` checks its length); NaN and inf become None."""
    out = list(out)
    if len(out) != len(completions):
        raise ValueError(f"returned {len(out)} scores for {len(completions)} completions; "
                         f"a reward function must return one score (or None) per completion")
    return [[_score(v) for v in value] if isinstance(value, (list, tuple)) else _score(value) for value in out]


def _score(value: Any) -> float | None:
    value = None if value is None else float(value)
    return value if value is not None and math.isfinite(value) else None


def as_steps(out: Any, completions: list[str]) -> list[list[tuple[int, float]] | None]:
    """A step scorer's output -> sorted [(char_end, reward), ...] per completion, checked."""
    out = list(out)
    if len(out) != len(completions):
        raise ValueError(f"returned steps for {len(out)} of {len(completions)} completions")
    result = []
    for steps, text in zip(out, completions):
        checked = []
        for end, reward in steps:
            end, reward = int(end), float(reward)
            if not 0 < end <= len(text) + 1:  # len(text) + 1: the step ends with the completion (its EOS)
                raise ValueError(f"step char_end {end} is outside the completion (length {len(text)}; "
                                 f"{len(text) + 1} ends a step with the completion itself)")
            if math.isfinite(reward):
                checked.append((end, reward))
        result.append(sorted(checked, key=lambda step: step[0]))  # stable: the scorer's order within one end
    return result
