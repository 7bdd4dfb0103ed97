"""Rewards: score a batch of completions, per completion (outcome) or per reasoning step (process).

The contract. The `reward` config group builds one reward; the trainer calls it once per rollout:

    result = build(cfg.reward)(prompts, completions, columns)   # -> RewardResult
    advantages = outcome_advantages(result.rewards) if result.steps is None else process_advantages(...)

`prompts` are the examples' questions and `completions` the sampled texts, one per completion; `columns`
holds the examples' other fields as lists in the same order (`answer`, a dataset's columns, ...) plus what
the rollout knows: `completion_length` (tokens, list[int]), `truncated` (list[bool]) and `completion_ids`
(list[list[int]]) (`call.score` builds them). The reward returns a `RewardResult` (`result`): `rewards`, one
float per completion or None for "no score"; `per_function`, each function's raw scores for the metrics;
`failures`; and for a process reward `steps`, per completion `[(char_end, reward), ...]`, whose reward
goes to the token holding the step's last character. A reward that also answers `names()` and `needs()`
(the combiners do) is checked against the data before any model loads (`call.check_columns`).

A reward function is a plain callable, `fn(prompts, completions, **columns) -> list[float | None]`,
built from YAML with `_partial_: true` so its options live there; it takes the columns it needs by
name and ignores the rest through `**_`. None means "no score" (for example, no reference answer).

The rooms: `result` (the record), `guard` (the timeout runner every function runs in), `combine`
(`OutcomeReward`, `ProcessReward`: functions -> one result), `call` (a command calling a reward),
`outcome` and `steps` (rule-based functions),
`models` (learned ORM/PRM), `user` (the user's own functions, called as TRL calls them). Where this
departs from the paper: rule-based rewards by default (DeepSeekMath trains a reward model), and each
function runs guarded, so a broken one costs its completions their score, never the run.

The names below stay importable from here because configs name them: `_target_:
grpo_cli.rewards.OutcomeReward` in conf/reward/*.yaml and in saved runs' config.yaml.
"""

from __future__ import annotations

import dataclasses

from grpo_cli.checks import Check, Rule, is_int, is_num
from grpo_cli.rewards import combine
from grpo_cli.rewards.combine import OutcomeReward, ProcessReward
from grpo_cli.rewards.outcome import (
    accuracy,
    answers_match,
    extract_answer,
    format_reward,
    length_penalty,
    reference_answer,
)
from grpo_cli.rewards.result import RewardResult
from grpo_cli.rewards.steps import chain_step_rewards, chain_steps, split_steps, step_rewards, verify_steps

__all__ = [
    "OutcomeReward", "ProcessReward", "RewardResult",
    "accuracy", "answers_match", "extract_answer", "format_reward", "length_penalty", "reference_answer",
    "chain_step_rewards", "chain_steps", "split_steps", "step_rewards", "verify_steps", "overlong_shaping",
]


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
    *combine.CHECKS,
    Rule("algo.overlong_buffer", lambda v: v is None or (is_int(v) and v >= 1),
         "must be an integer >= 1 (tokens before sampler.max_new_tokens) or null (off); "
         "set algo.overlong_buffer=null"),
    Rule("algo.overlong_penalty", lambda v: is_num(v) and v >= 0,
         "must be a number >= 0 (DAPO's is 1); set algo.overlong_penalty=1.0"),
    _check_overlong,
]
