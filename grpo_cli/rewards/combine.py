"""The combiners: many reward functions -> one `RewardResult` per batch.

`OutcomeReward` sums the functions' scores with weights (DeepSeekMath §4.1.2: one scalar reward per
completion). `ProcessReward` takes a step scorer that returns `(char_end, reward)` per step (§4.1.3);
the reward of a step goes to the token holding character `char_end - 1` of the completion, the step's
last character. Both run each function through `guard.Guarded` (a timeout, and a failure costs scores,
not the run) and answer `names()` (the `per_function` keys they report) and `needs()` (the columns each
function cannot do without), which the commands read before any model loads.

Where this departs from the paper: rule-based functions by default (the paper trains a reward model), and
a process reward may carry outcome functions whose advantage is added to the step one with weight λ
(`process_weight`; PRIME, arXiv 2502.01456; PURE, 2504.15275); the paper uses step rewards alone.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
from collections.abc import Callable

from grpo_cli.checks import Check, Rule, is_num, one_of
from grpo_cli.errors import ConfigError
from grpo_cli.objective import CREDITS
from grpo_cli.rewards.guard import WORKERS, Guarded, as_scores, as_steps
from grpo_cli.rewards.result import RewardResult

log = logging.getLogger(__name__)

# column names that would collide with the positional arguments of a reward function
_RESERVED = ("prompts", "completions")


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
    call on a batch, run where `worker` says (`guard.Guarded`).
    """

    def __init__(self, functions: dict[str, Callable], weights: dict[str, float] | None, timeout_s: float | None,
                 worker: str):
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
        self._calls = {name: Guarded(str(name), fn, timeout_s, as_scores, worker) for name, fn in functions.items()}

    def names(self) -> list[str]:
        """The names its raw scores go under (`per_function`, `rewards/<name>/mean`), one per function."""
        return list(self._calls)

    def needs(self) -> dict[str, list[str]]:
        """Per function, the columns it cannot do without (`_needs`)."""
        return {name: _needs(call.fn) for name, call in self._calls.items()}

    def in_workers(self) -> list[str]:
        """The functions that run in worker processes (`reward.worker=process`): every column must pickle for them."""
        return [name for name, call in self._calls.items() if call.in_process]

    def __call__(self, prompts: list[str], completions: list[str],
                 columns: dict[str, list] | None = None) -> RewardResult:
        columns = _columns(columns)
        per_function: dict[str, list[float | None]] = {}
        failures = 0
        for name, call in self._calls.items():
            per_function[name], failed = call(list(prompts), list(completions), columns)
            failures += failed
        if any(isinstance(s, list) for scores in per_function.values() for s in scores):
            counts = _turn_counts(columns, len(completions))
            if any(counts):
                return self._by_turn(per_function, failures, counts)
            failures += self._no_turns(per_function)
        rewards: list[float | None] = []
        for i in range(len(completions)):
            scored = [(self.weights[name], s[i]) for name, s in per_function.items() if s[i] is not None]
            rewards.append(sum(w * s for w, s in scored) if scored else None)
        return RewardResult(rewards=rewards, per_function=per_function, failures=failures)

    @staticmethod
    def _no_turns(per_function: dict[str, list]) -> int:
        """Per-turn scores for completions that are no episodes: no score; the functions that gave them failed."""
        failed = [name for name, scores in per_function.items() if any(isinstance(s, list) for s in scores)]
        for name in failed:
            log.warning("reward %r returned a list of scores for a completion that is not a multi-turn episode; "
                        "return one score per completion (lists score the turns of env=tools or env=class "
                        "episodes): those completions get no score from it", name)
            per_function[name] = [None if isinstance(s, list) else s for s in per_function[name]]
        return len(failed)

    def _by_turn(self, per_function: dict[str, list], failures: int, counts: list[int]) -> RewardResult:
        """Per-turn rewards: turn t of an episode gets Σ weight · score_t over the functions that scored it; a
        function's list is one score per assistant turn, its number the episode's, on its last turn. A list of
        another length (or for a completion that is no episode: 0 turns) is no score, and the function's failure."""
        turns: list[list[float | None]] = [[None] * k for k in counts]
        for name, scores in per_function.items():
            wrong = [i for i, s in enumerate(scores) if isinstance(s, list) and len(s) != counts[i]]
            if wrong:
                failures += 1
                log.warning("reward %r returned %d scores for an episode of %d assistant turns; a per-turn reward "
                            "returns one score per turn (or one number for the episode): that episode gets no score "
                            "from it", name, len(scores[wrong[0]]), counts[wrong[0]])
            for i, s in enumerate(scores):
                if i in wrong or not counts[i]:
                    continue
                given = s if isinstance(s, list) else [None] * (counts[i] - 1) + [s]
                for t, v in enumerate(given):
                    if v is not None:
                        turns[i][t] = (turns[i][t] or 0.0) + self.weights[name] * v
            # the raw score for the metrics (rewards/<name>/mean): the episode's, its turns summed
            per_function[name] = [None if i in wrong else _summed(s) for i, s in enumerate(scores)]
        rewards = [sum(v for v in row if v is not None) if any(v is not None for v in row) else None
                   for row in turns]
        return RewardResult(rewards=rewards, per_function=per_function, failures=failures, turns=turns)


class ProcessReward:
    """Per-step rewards from `scorer`; a completion's reward is the sum of its step rewards.

    `scorer(prompts, completions, **columns)` returns, per completion, [(char_end, reward), ...]; char_end
    len(text) + 1 (`steps.end_of_completion`) ends a step with the completion, on its EOS token.
    `outcome` functions are scored for the metrics (`per_function`). With `process_weight` λ (a number
    >= 0) they are also the outcome half of the advantage, A = A_outcome + λ·A_process, each normalized on
    its own within the group (PRIME, arXiv 2502.01456; PURE, 2504.15275): the answer's credit does not
    shrink as the step count grows. None or inf: the step rewards alone (the paper's §4.1.3). `credit`: how a
    token's advantage gathers the steps after it, "sum" (the paper's) or "min" (PURE's).
    """

    def __init__(self, scorer: Callable, outcome: dict[str, Callable] | None, timeout_s: float | None,
                 process_weight: float | None, worker: str, credit: str):
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
        self.credit = credit
        self.process_weight = None if process_weight is None else float(process_weight)
        self._scorer = Guarded("steps", scorer, timeout_s, as_steps, worker)
        self._outcome = OutcomeReward(outcome, weights=None, timeout_s=timeout_s, worker=worker) if outcome else None

    def names(self) -> list[str]:
        """`steps` (each completion's mean step reward), then the outcome functions' names."""
        return ["steps", *(self._outcome.names() if self._outcome is not None else [])]

    def needs(self) -> dict[str, list[str]]:
        """The columns the step scorer (as `scorer`) and each outcome function cannot do without."""
        return {"scorer": _needs(self._scorer.fn), **(self._outcome.needs() if self._outcome is not None else {})}

    def in_workers(self) -> list[str]:
        """The step scorer (as `steps`) and the outcome functions that run in worker processes."""
        return [*(["steps"] if self._scorer.in_process else []),
                *(self._outcome.in_workers() if self._outcome is not None else [])]

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
                            outcome=outcome, process_weight=self.process_weight, credit=self.credit)


def _summed(score: float | list[float | None] | None) -> float | None:
    """A score, or a list of per-turn scores summed (None: none of them scored)."""
    if not isinstance(score, list):
        return score
    scored = [v for v in score if v is not None]
    return sum(scored) if scored else None


def _turn_counts(columns: dict[str, list], n: int) -> list[int]:
    """Each completion's assistant turns (an episode's `completion_messages`); 0 for a plain completion."""
    messages = columns.get("completion_messages") or [[]] * n
    return [sum(m.get("role") == "assistant" for m in episode) for episode in messages]


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

# ---- config checks: this module's settings, collected by config.validate --------------------------------

def _finite(weights) -> bool:
    """Every weight a finite number (a dict by function name, a list in reward.funcs' order, or one number)."""
    values = weights.values() if hasattr(weights, "values") else weights if hasattr(weights, "__iter__") else [weights]
    return all(is_num(w) and math.isfinite(w) for w in values)


CHECKS: list[Check] = [
    Rule("reward.weights", lambda v: v is None or (not isinstance(v, str) and _finite(v)),
         "must hold finite numbers (one NaN or inf weight makes every reward NaN or inf, and the run learns nothing); "
         "set reward.weights to finite numbers (1.0 each: reward.weights=null)"),
    Rule("reward.worker", lambda v: v in WORKERS,
         f"must be {' or '.join(WORKERS)}; set reward.worker=process (reward.worker=thread for functions given "
         f"objects that cannot be pickled)"),
    # inf is ProcessReward's other spelling of null (λ so large the outcome half does not count)
    Rule("reward.process_weight", lambda v: v is None or v == math.inf or (is_num(v) and v >= 0),
         "must be a number >= 0 (λ of A_outcome + λ·A_process) or null (step rewards alone); "
         "set reward.process_weight=1.0"),
    Rule("reward.credit", lambda v: v in CREDITS,
         f"must be {one_of(CREDITS)} (sum: the paper's, min: PURE's min-form); set reward.credit=sum"),
    Rule("reward.timeout_s", lambda v: v is None or (is_num(v) and v > 0),
         "must be > 0 seconds or null (wait forever); set reward.timeout_s=10"),
]
