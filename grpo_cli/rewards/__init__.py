"""Rewards: score a batch of completions, per completion (outcome) or per reasoning step (process).

The contract. The `reward` config group builds one reward; the trainer calls it once per rollout:

    result = build(cfg.reward)(prompts, completions, columns)   # -> RewardResult
    advantages = credit.advantages(credit.token_rewards(result, rollout, tokenizer), ...)   # grpo_cli.credit

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

The rooms: `result` (the record), `guard` (the timeout runner every function runs in; `worker`: a function's
own worker process), `combine`
(`OutcomeReward`, `ProcessReward`: functions -> one result), `call` (a command calling a reward),
`shaping` (truncation floor, DAPO's overlong penalty), `outcome` and `steps` (rule-based functions),
`models` (learned ORM/PRM), `user` (the user's own functions, called as TRL calls them). Where this
departs from the paper: rule-based rewards by default (DeepSeekMath trains a reward model), and each
function runs guarded, so a broken one costs its completions their score, never the run.

The names below stay importable from here because configs name them: `_target_:
grpo_cli.rewards.OutcomeReward` in conf/reward/*.yaml and in saved runs' config.yaml.
"""

from __future__ import annotations

from grpo_cli.checks import Check
from grpo_cli.rewards import combine, judge
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
    "chain_step_rewards", "chain_steps", "split_steps", "step_rewards", "verify_steps",
]

# this package's settings, collected by config.validate
CHECKS: list[Check] = [*combine.CHECKS, *judge.CHECKS]
