"""Calling a built reward from a command: its columns from the examples and the rollout, and the checks
made before any model loads.

    result = score(reward, examples, rollout)   # examples [B], rollout [B * G rows]: one RewardResult

`score` hands a reward each example's question as `prompts` and its other fields (`answer`, a dataset's
columns, ...) as columns, plus what the rollout knows: `completion_length` (tokens, list[int]),
`truncated` (list[bool]), `completion_ids` (list[list[int]], `token_ids`) and, for episodes, their
messages, tool-call counts and environments (`reward_columns`). `check_columns` (on `column_example`) and
`function_names` read a reward's own `needs()` and `names()` (`combine`); a reward of another kind,
without them, is its own business. Nothing here is in the paper: it is the glue between a rollout and
the reward contract (`grpo_cli.rewards`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from grpo_cli import workers
from grpo_cli.env import ClassEnv, environment_rewards, prepare
from grpo_cli.errors import ConfigError
from grpo_cli.rewards.result import RewardResult

# an example's keys that are not columns: the chat messages and the prompt's text (passed as `prompts`)
_NOT_COLUMNS = ("messages", "question")

# what TRL's GRPOTrainer passes a reward function besides the columns, and grpo does not
_TRL_ONLY = {"trainer_state": "TRL's TrainerState (global_step, max_steps, ...)",
             "log_extra": "TRL's callback for logging extra columns"}


# the episodes' column holding the environments' own scores (env=class with get_reward): a reward source of its
# own, added by `score`, never handed to reward functions
ENVIRONMENT_REWARD = "environment_reward"


def score(reward_fn, examples: list[dict], rollout) -> RewardResult:
    """Call a built reward on a rollout's completions, rows grouped by example: row j answers
    examples[j // (rows / len(examples))] (G completions each; eval hands the greedy row and the samples of each
    problem as examples of their own).

    The reward sees each example's question as `prompts` and its other fields (`answer`, a dataset's columns,
    ...) as columns, in the order of the completions, plus what the rollout knows: the completions' token lengths,
    truncation flags and token ids, and for multi-turn episodes the columns `reward_columns` makes (their
    messages, tool-call counts, environments). An environment's own score (`ENVIRONMENT_REWARD`) is added to the
    result as one more source (`with_environment`).
    """
    rows = len(rollout.texts)
    if not examples or rows % len(examples):
        raise ValueError(f"{rows} completions do not group evenly under {len(examples)} examples")
    per = rows // len(examples)
    owners = [i for i in range(len(examples)) for _ in range(per)]
    keys = [k for k in examples[0] if k not in _NOT_COLUMNS]
    columns = {k: [examples[i].get(k) for i in owners] for k in keys}
    known = {"completion_length": rollout.lengths, "truncated": rollout.truncated,
             "completion_ids": token_ids(rollout)}
    episodes = reward_columns(rollout)
    own = episodes.pop(ENVIRONMENT_REWARD, None)
    result = reward_fn([examples[i]["question"] for i in owners], rollout.texts, {**columns, **known, **episodes})
    return result if own is None else with_environment(result, own)


def reward_columns(rollout) -> dict[str, list]:
    """What a reward reads of episodes, as TRL passes it: each completion's messages (the assistant and tool turns;
    a user's function gets them as `completions`), its tool-call count and, for env=class, its environment
    instance (`environments`); {} for plain completions."""
    if rollout.episodes is None:
        return {}
    columns = {"completion_messages": [e.messages for e in rollout.episodes],
               "tool_call_count": [e.tool_calls for e in rollout.episodes]}
    if any(e.environment is not None for e in rollout.episodes):
        columns["environments"] = [e.environment for e in rollout.episodes]
        # an environment's get_reward: a reward source of its own (`score` adds it)
        columns[ENVIRONMENT_REWARD] = environment_rewards(rollout.episodes)
    return columns


def column_example(env, example: dict) -> dict[str, Any]:
    """`example` with the columns `reward_columns` adds for a run with `env`, with one completion's values, for the
    checks made before the model loads (`check_columns`): a reward function's needs are checked against their
    names, and a function in a worker process must be able to receive their values. For env=class the environment
    is one built and reset on `example`'s row, as its first episode's will be (an instance that opens a file in
    reset() does not pickle from then on)."""
    if env is None:
        return dict(example)
    columns: dict[str, Any] = {"completion_messages": [], "tool_call_count": 0}
    if isinstance(env, ClassEnv):
        columns["environments"] = prepare(env, [example])[1][0].environment
    return {**example, **columns}


def with_environment(result: RewardResult, own: list[tuple[str, float | None, bool] | None]) -> RewardResult:
    """`result` with the environments' own scores added, as TRL adds `get_reward`: each class one more source of
    weight 1 (`per_function` under the class's name), summed into a completion's reward where it scored (an
    unscored completion's reward stays None unless the environment scored it); with per-turn rewards it joins
    the episode's last turn, with outcome-and-process rewards the outcome. `own`: per completion, (class name,
    score or None, whether get_reward raised), or None (grpo_cli.env.environment_rewards); a raise is a failure."""
    names = sorted({o[0] for o in own if o is not None})
    if not names:
        return result
    sources = {name: [o[1] if o is not None and o[0] == name else None for o in own] for name in names}
    failures = sum(o is not None and o[2] for o in own)
    rewards = list(result.rewards)
    outcome = None if result.outcome is None else list(result.outcome)
    turns = None if result.turns is None else [list(t) for t in result.turns]

    def plus(value: float | None, score: float) -> float:
        return score if value is None else value + score

    for scores in sources.values():
        for i, s in enumerate(scores):
            if s is None:
                continue
            rewards[i] = plus(rewards[i], s)
            if outcome is not None:
                outcome[i] = plus(outcome[i], s)
            if turns is not None and turns[i]:
                turns[i][-1] = plus(turns[i][-1], s)
    return replace(result, rewards=rewards, per_function={**result.per_function, **sources},
                   failures=result.failures + failures, outcome=outcome, turns=turns)


def token_ids(rollout) -> list[list[int]]:
    """Each completion's token ids up to and including its EOS (a Rollout's `completion_ids` column)."""
    return [ids[mask.bool()].tolist() for ids, mask in zip(rollout.completion_ids, rollout.completion_mask)]


def function_names(reward_fn) -> list[str] | None:
    """The names a reward reports its raw scores under (`per_function`, `rewards/<name>/mean`), or None for a
    reward without `names()` (they are known once it has run)."""
    names = getattr(reward_fn, "names", None)
    return names() if callable(names) else None


def check_columns(reward_fn, example: dict) -> None:
    """ConfigError, before any model loads, when a reward function needs a column the data's examples lack
    (the accuracy reward's `answer` on a dataset without one): its run would score nothing; or when a function runs
    in a worker process and a column of `example` (its values as one completion's, an `env=class` environment
    among them) cannot be sent to it: its first call would fail at step 1. A reward without `needs()` is not
    checked."""
    _check_sendable(reward_fn, example)
    needs = getattr(reward_fn, "needs", None)
    if not callable(needs):
        return
    have = [k for k in example if k not in (*_NOT_COLUMNS, "prompt")]
    have += ["completion_length", "truncated", "completion_ids"]
    for name, columns in needs().items():
        missing = [column for column in columns if column not in have]
        trl = [column for column in missing if column in _TRL_ONLY]
        if trl:
            raise ConfigError(f"reward function {name!r} takes {trl[0]}, {_TRL_ONLY[trl[0]]}, which grpo does not "
                              f"pass to reward functions; give it a default ({trl[0]}=None) and do without it there, "
                              f"or drop it")
        if missing:
            raise ConfigError(f"reward function {name!r} needs column {missing[0]!r}, which the data does not have "
                              f"(it has: {', '.join(have)}); add that column to the data, or choose a reward whose "
                              f"functions need none (reward=custom reward.funcs=[...])")


def _check_sendable(reward_fn, example: dict) -> None:
    """Every column a worker process is sent (the chat messages are not: the prompts are) pickles, or one line
    naming the fix."""
    in_workers = getattr(reward_fn, "in_workers", None)
    names = in_workers() if callable(in_workers) else []
    if not names:
        return
    for column, value in example.items():
        why = None if column == "messages" else workers.unsendable(value)
        if why is not None:
            raise ConfigError(f"reward function {names[0]!r} runs in a worker process (reward.worker=process) and is "
                              f"given column {column!r} (a {type(value).__name__}), which cannot be sent to it ({why})"
                              f"; set reward.worker=thread to run the reward functions in this process")
