"""Rewards: score a batch of completions, per completion (outcome) or per reasoning step (process).

The `reward` config group builds one combiner; the trainer calls it once per rollout:

    result = instantiate(cfg.reward)(prompts, completions, columns)   # -> RewardResult
    advantages = outcome_advantages(result.rewards) if result.steps is None else process_advantages(...)

`columns` holds the examples' other fields as lists (`answer`, a dataset's columns, ...) plus what the
rollout knows: `completion_length` (tokens, list[int]), `truncated` (list[bool]) and `completion_ids`
(list[list[int]]). `check_columns` stops a run before the model loads when a function needs a
column the data lacks. Functions from the user's own code, called as TRL calls them: `user.py`.

A reward function is a plain callable, `fn(prompts, completions, **columns) -> list[float | None]`,
built from YAML with `_partial_: true` so its options live there; it takes the columns it needs by
name and ignores the rest through `**_`. None means "no score" (for example, no reference answer).

`OutcomeReward` sums the functions' scores with weights (DeepSeekMath §4.1.2: one scalar reward per
completion). `ProcessReward` takes a step scorer that returns `(char_end, reward)` per step
(§4.1.3); the reward of a step goes to the token holding character `char_end - 1` of the
completion, the step's last character. Where this departs from the paper: rule-based rewards by
default (the paper trains a reward model), and a robustness layer the paper does not need: each
function runs in a worker thread with a timeout, and one that raises (even SystemExit), hangs or
returns garbage costs its completions their score (None), never the run; a ConfigError (a bad
option) stops it with the fix, and KeyboardInterrupt (Ctrl-C) passes through.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import math
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from grpo_cli.checks import Check, Rule, is_int, is_num
from grpo_cli.errors import ConfigError
from grpo_cli.rewards.outcome import (
    accuracy,
    answers_match,
    extract_answer,
    format_reward,
    length_penalty,
    reference_answer,
)
from grpo_cli.rewards.steps import chain_step_rewards, chain_steps, split_steps, step_rewards, verify_steps

__all__ = [
    "OutcomeReward", "ProcessReward", "RewardResult", "score", "check_columns", "function_names", "token_ids",
    "accuracy",
    "answers_match", "extract_answer", "reference_answer",
    "chain_step_rewards", "chain_steps", "format_reward", "length_penalty", "split_steps", "step_rewards",
    "verify_steps",
]

log = logging.getLogger(__name__)

# column names that would collide with the positional arguments of a reward function
_RESERVED = ("prompts", "completions")


@dataclass
class RewardResult:
    """What one reward call gives the trainer.

    rewards: per completion; None = no score (every function gave None or failed).
    per_function: raw (unweighted) scores per function name, for `rewards/<name>/mean` metrics; a
        process reward adds `steps`, each completion's mean step reward.
    failures: function calls (one per function per batch) that raised, timed out or returned a
        malformed result. A call that raised is retried one completion at a time, so only the
        completions it fails on lose their score.
    steps: process rewards only: per completion, [(char_end, reward), ...] in text order, char_end
        exclusive (several steps may share one); [] when the completion has no scored step. None for
        outcome rewards.
    outcome: process rewards combined with outcome ones: per completion, the outcome functions' sum.
    process_weight: λ of A = A_outcome + λ·A_process (`update.advantages`); None: process only.
    """

    rewards: list[float | None]
    per_function: dict[str, list[float | None]]
    failures: int = 0
    steps: list[list[tuple[int, float]]] | None = None
    outcome: list[float | None] | None = None
    process_weight: float | None = None


def _failed(err: BaseException) -> bool:
    """Whether an exception from a reward function is the function's failure (its completions lose their
    score) rather than the user stopping the run. SystemExit counts as a failure: a library that calls
    sys.exit() on odd input must not end training without a word."""
    return not isinstance(err, (KeyboardInterrupt, ConfigError))


class _Guarded:
    """One scoring function run in a worker thread with a timeout; raises only ConfigError and
    KeyboardInterrupt.

    A timed-out thread cannot be killed in Python, so it runs on as a daemon (it does not block
    interpreter exit), and while it still runs the function is not called again: its next calls
    give None at once instead of piling up threads. With timeout_s null the function runs inline
    on the caller's thread and nothing bounds it: a hung function hangs the step; Ctrl-C (twice
    during training) raises KeyboardInterrupt in it, which passes through.
    """

    def __init__(self, name: str, fn: Callable, timeout_s: float | None,
                 convert: Callable[[Any, list[str]], list]):
        self.name, self.fn, self.timeout_s, self.convert = name, fn, timeout_s, convert
        self._thread: threading.Thread | None = None
        self._warned = False

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
        try:
            return self.convert(self._in_thread(lambda: self.fn(prompts, completions, **columns)), completions), False
        except FutureTimeout:
            self._warn(f"took longer than timeout_s={self.timeout_s} s; raise reward.timeout_s if it is "
                       f"just slow")
            return [None] * n, True
        except BaseException as err:
            if not _failed(err):  # a bad option (a broken regex, buffer 0) fails every call: stop with the fix
                raise
            self._warn(f"raised {err!r}; fix the function (it is retried one completion at a time)")

        def one_by_one() -> list:
            out = []
            for i in range(n):
                try:
                    single = self.fn(prompts[i:i + 1], completions[i:i + 1],
                                     **{k: v[i:i + 1] for k, v in columns.items()})
                    out.append(self.convert(single, completions[i:i + 1])[0])
                except BaseException as err:
                    if isinstance(err, KeyboardInterrupt):
                        raise
                    out.append(None)
            return out

        try:
            return self._in_thread(one_by_one), True
        except BaseException as err:
            if isinstance(err, KeyboardInterrupt):
                raise
            return [None] * n, True


def _scores(out: Any, completions: list[str]) -> list[float | None]:
    """A reward function's output -> one float or None per completion; NaN and inf become None."""
    out = list(out)
    if len(out) != len(completions):
        raise ValueError(f"returned {len(out)} scores for {len(completions)} completions; "
                         f"a reward function must return one score (or None) per completion")
    scores: list[float | None] = []
    for value in out:
        value = None if value is None else float(value)
        scores.append(value if value is not None and math.isfinite(value) else None)
    return scores


def _steps(out: Any, completions: list[str]) -> list[list[tuple[int, float]] | None]:
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


def _check_options(path: str, fn: Callable) -> None:
    """A `_partial_` function's YAML options must be its named parameters.

    Reward functions take `**_` to ignore unknown columns, which would also swallow a misspelt
    option silently; this catches it when the reward is built.
    """
    if not isinstance(fn, functools.partial):
        return
    try:
        params = inspect.signature(fn.func).parameters
    except (TypeError, ValueError):
        return
    named = [p for p, v in params.items() if v.kind not in (v.VAR_KEYWORD, v.VAR_POSITIONAL)]
    for key in fn.keywords:
        if key not in named:
            allowed = ", ".join(p for p in named if p not in _RESERVED)
            raise ConfigError(f"{path}.{key} is not a parameter of {getattr(fn.func, '__qualname__', fn.func)}; "
                              f"remove it or use one of: {allowed}")


def _columns(columns: dict[str, list] | None) -> dict[str, list]:
    return {k: list(v) for k, v in (columns or {}).items() if k not in _RESERVED}


class OutcomeReward:
    """Weighted sum of outcome reward functions: one scalar per completion.

    A function missing from `weights` has weight 1.0. A completion's reward sums weight * score over
    the functions that scored it; it is None only when none did. `timeout_s` bounds each function's
    call on a batch; null runs the functions inline, without a thread or a timeout (so math-verify can
    use its own signal timeouts), and then nothing bounds a function that hangs: only Ctrl-C stops it.
    """

    def __init__(self, functions: dict[str, Callable], weights: dict[str, float] | None = None,
                 timeout_s: float | None = 10.0):
        functions = dict(functions or {})
        if not functions:
            raise ConfigError("reward.functions is empty: add at least one, e.g. reward=arithmetic")
        for name, fn in functions.items():
            if not callable(fn):
                raise ConfigError(f"reward.functions.{name} is not callable: give it a _target_ "
                                  f"(and `_partial_: true` for a plain function)")
            _check_options(f"reward.functions.{name}", fn)
        weights = {str(k): float(v) for k, v in dict(weights or {}).items()}
        unknown = sorted(set(weights) - set(functions))
        if unknown:
            raise ConfigError(f"reward.weights.{unknown[0]} has no function of that name; remove it or "
                              f"use one of: {', '.join(functions)}")
        self.weights = {name: weights.get(name, 1.0) for name in functions}
        self.timeout_s = timeout_s
        self._calls = {name: _Guarded(str(name), fn, timeout_s, _scores) for name, fn in functions.items()}

    def __call__(self, prompts: list[str], completions: list[str],
                 columns: dict[str, list] | None = None) -> RewardResult:
        columns = _columns(columns)
        per_function: dict[str, list[float | None]] = {}
        failures = 0
        for name, call in self._calls.items():
            per_function[name], failed = call(list(prompts), list(completions), columns)
            failures += failed
        rewards: list[float | None] = []
        for i in range(len(completions)):
            scored = [(self.weights[name], s[i]) for name, s in per_function.items() if s[i] is not None]
            rewards.append(sum(w * s for w, s in scored) if scored else None)
        return RewardResult(rewards=rewards, per_function=per_function, failures=failures)


class ProcessReward:
    """Per-step rewards from `scorer`; a completion's reward is the sum of its step rewards.

    `scorer(prompts, completions, **columns)` returns, per completion, [(char_end, reward), ...]; char_end
    len(text) + 1 (`steps.end_of_completion`) ends a step with the completion, on its EOS token.
    `outcome` functions are scored for the metrics (`per_function`). With `process_weight` λ (a number
    >= 0) they are also the outcome half of the advantage, A = A_outcome + λ·A_process, each normalized on
    its own within the group (PRIME, arXiv 2502.01456; PURE, 2504.15275): the answer's credit does not
    shrink as the step count grows. None or inf: the step rewards alone (the paper's §4.1.3).
    """

    def __init__(self, scorer: Callable, outcome: dict[str, Callable] | None = None,
                 timeout_s: float | None = 10.0, process_weight: float | None = None):
        if not callable(scorer):
            raise ConfigError("reward.scorer is not callable: give it a _target_ (and `_partial_: true` "
                              "for a plain function such as grpo_cli.rewards.steps.step_rewards)")
        _check_options("reward.scorer", scorer)
        outcome = dict(outcome or {})
        if "steps" in outcome:
            raise ConfigError("reward.outcome.steps clashes with the step metric of the same name; rename it")
        if process_weight is not None and math.isinf(process_weight):
            process_weight = None
        if process_weight is not None and not outcome:
            raise ConfigError(f"reward.process_weight ({process_weight}) weighs step credit against an outcome "
                              f"reward, and reward.outcome is empty; add one (e.g. accuracy) or set "
                              f"reward.process_weight=null (step rewards alone)")
        self.timeout_s = timeout_s
        self.process_weight = None if process_weight is None else float(process_weight)
        self._scorer = _Guarded("steps", scorer, timeout_s, _steps)
        self._outcome = OutcomeReward(outcome, timeout_s=timeout_s) if outcome else None

    def __call__(self, prompts: list[str], completions: list[str],
                 columns: dict[str, list] | None = None) -> RewardResult:
        columns = _columns(columns)
        scored, failed = self._scorer(list(prompts), list(completions), columns)
        steps = [s if s is not None else [] for s in scored]
        rewards = [sum(r for _, r in s) if s else None for s in steps]
        per_function = {"steps": [sum(r for _, r in s) / len(s) if s else None for s in steps]}
        failures = int(failed)
        outcome = None
        if self._outcome is not None:
            extra = self._outcome(prompts, completions, columns)
            per_function.update(extra.per_function)
            failures += extra.failures
            outcome = extra.rewards if self.process_weight is not None else None
        return RewardResult(rewards=rewards, per_function=per_function, failures=failures, steps=steps,
                            outcome=outcome, process_weight=self.process_weight)


# an example's keys that are not columns: the chat messages and the prompt's text (passed as `prompts`)
_NOT_COLUMNS = ("messages", "question")


def score(reward_fn, examples: list[dict], owners: list[int], texts: list[str], lengths: list[int],
          truncated: list[bool], completion_ids: list[list[int]] | None = None) -> RewardResult:
    """Call a built reward on completions; completion j answers examples[owners[j]].

    The reward sees each example's question as `prompts` and its other fields (`answer`, a dataset's
    columns, ...) as columns, in the order of the completions, plus the completions' token lengths,
    truncation flags and (when given) token ids.
    """
    keys = [k for k in examples[0] if k not in _NOT_COLUMNS]
    columns = {k: [examples[i].get(k) for i in owners] for k in keys}
    rollout = {"completion_length": lengths, "truncated": truncated}
    if completion_ids is not None:
        rollout["completion_ids"] = completion_ids
    return reward_fn([examples[i]["question"] for i in owners], texts, {**columns, **rollout})


def overlong_shaping(result: RewardResult, lengths: list[int], max_length: int, buffer: int | None,
                     penalty: float = 1.0) -> RewardResult:
    """DAPO's soft overlong punishment (`outcome.length_penalty`, arXiv 2503.14476 eq. 13) added to any reward.

    buffer None: `result` as it is. Otherwise each completion of L tokens gets
    length_penalty(L; L_max=max_length, L_cache=buffer) · penalty, 0 down to -penalty over the last `buffer`
    tokens before the cap: added to an outcome reward (a completion without a score keeps none), or to the
    last step's reward of a process reward (the step whose text ran into the buffer; a completion with no
    scored step has no reward to shape and keeps none). Logged as `rewards/overlong/mean`.
    """
    if buffer is None:
        return result
    shaped = length_penalty(None, None, completion_length=lengths, max_length=max_length, buffer=buffer,
                            penalty=penalty)
    rewards = [r if r is None or p is None else r + p for r, p in zip(result.rewards, shaped)]
    steps = result.steps
    if steps is not None:
        steps = [s[:-1] + [(s[-1][0], s[-1][1] + p)] if s and p is not None else s for s, p in zip(steps, shaped)]
        rewards = [sum(r for _, r in s) if s else None for s in steps]
    return dataclasses.replace(result, rewards=rewards, per_function={**result.per_function, "overlong": shaped},
                               steps=steps)


def token_ids(rollout) -> list[list[int]]:
    """Each completion's token ids up to and including its EOS (a Rollout's `completion_ids` column)."""
    return [ids[mask.bool()].tolist() for ids, mask in zip(rollout.completion_ids, rollout.completion_mask)]


def _needs(fn: Callable) -> list[str]:
    """The columns a reward function cannot do without: its parameters that have no default, other than the
    prompts and completions (the first two positional ones, or by name for a TRL-style function)."""
    keyword = getattr(fn, "user_function", None)  # grpo_cli.rewards.user.TRLFunction: called by keyword
    try:
        params = list(inspect.signature(keyword or fn).parameters.values())
    except (TypeError, ValueError):
        return []
    if keyword is None:  # called as fn(prompts, completions, **columns): its first two positional parameters
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:2]
        params = [p for p in params if p not in positional]
    return [p.name for p in params if p.default is p.empty and p.name not in _RESERVED
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def function_names(reward_fn) -> list[str] | None:
    """The names a reward reports its raw scores under (`per_function`, `rewards/<name>/mean`), or None for a
    reward of another kind (it is known once it has run)."""
    if isinstance(reward_fn, ProcessReward):
        return ["steps", *(reward_fn._outcome._calls if reward_fn._outcome is not None else [])]
    if isinstance(reward_fn, OutcomeReward):
        return list(reward_fn._calls)
    return None


def check_columns(reward_fn, example: dict) -> None:
    """ConfigError, before any model loads, when a reward function needs a column the data's examples lack
    (the accuracy reward's `answer` on a dataset without one): its run would score nothing."""
    have = [k for k in example if k not in (*_NOT_COLUMNS, "prompt")]
    have += ["completion_length", "truncated", "completion_ids"]
    if isinstance(reward_fn, ProcessReward):
        functions = {"scorer": reward_fn._scorer.fn}
        if reward_fn._outcome is not None:
            functions.update({name: call.fn for name, call in reward_fn._outcome._calls.items()})
    elif isinstance(reward_fn, OutcomeReward):
        functions = {name: call.fn for name, call in reward_fn._calls.items()}
    else:  # a reward of another kind: its own business
        return
    for name, fn in functions.items():
        missing = [column for column in _needs(fn) if column not in have]
        if missing:
            raise ConfigError(f"reward function {name!r} needs column {missing[0]!r}, which the data does not have "
                              f"(it has: {', '.join(have)}); add that column to the data, or choose a reward whose "
                              f"functions need none (reward=custom reward.funcs=[...])")

# ---- config checks: this module's settings, collected by config.validate --------------------------------

def _check_overlong(cfg) -> list[str]:
    """The buffer lies inside the completion budget (eq. 13 needs L_cache <= L_max)."""
    buffer, budget = cfg.get("algo", {}).get("overlong_buffer"), cfg.get("sampler", {}).get("max_new_tokens")
    if is_int(buffer) and is_int(budget) and buffer > budget >= 1:  # buffer < 1 has its own line
        fit = max(1, budget // 4)
        return [f"algo.overlong_buffer ({buffer}) must be at most sampler.max_new_tokens ({budget}): the penalty "
                f"ramps over the last overlong_buffer tokens before the cap; set algo.overlong_buffer={fit}"]
    return []


CHECKS: list[Check] = [
    Rule("reward.process_weight", lambda v: v is None or (is_num(v) and v >= 0),
         "must be a number >= 0 (λ of A_outcome + λ·A_process) or null (step rewards alone); "
         "set reward.process_weight=1.0"),
    Rule("algo.overlong_buffer", lambda v: v is None or (is_int(v) and v >= 1),
         "must be an integer >= 1 (tokens before sampler.max_new_tokens) or null (off); "
         "set algo.overlong_buffer=null"),
    Rule("algo.overlong_penalty", lambda v: is_num(v) and v >= 0,
         "must be a number >= 0 (DAPO's is 1); set algo.overlong_penalty=1.0"),
    _check_overlong,
    Rule("reward.timeout_s", lambda v: v is None or (is_num(v) and v > 0),
         "must be > 0 seconds or null (wait forever); set reward.timeout_s=10"),
]
