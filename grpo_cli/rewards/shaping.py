"""Reward shaping: transforms of a `RewardResult` applied after the reward has scored a batch.

Two shapings, each a pure function of a result and the rollout's facts, sharing one step rewrite
(`_with_steps`: new steps per completion, each reward the sum of its steps, None without one):

  - `floor_truncated` (iterative.truncated_reward; `FlooredReward` applies it inside a reward's call): a
    completion cut at sampler.max_new_tokens scores a fixed floor instead of the reward model's score,
    so a policy cannot learn to ramble past the cap because a learned model likes long text (issue #28).
    A process result's truncated completion becomes one step of that reward; a per-turn one's, its last turn.
  - `overlong_shaping` (algo.overlong_buffer, algo.overlong_penalty): DAPO's soft overlong punishment
    (arXiv 2503.14476 eq. 13), 0 down to -penalty over the last `buffer` tokens before the cap, added to
    an outcome reward or to a process result's last step (a per-turn one's last turn). The cap is the budget
    that cuts the row (`overlong_lengths`): sampler.max_new_tokens for a completion, env.max_episode_tokens
    for an episode, whose every token after the prompt counts against it.

`shape` applies both in the trainer's order: the floor first, then the overlong penalty on top of it.
Neither is in DeepSeekMath's GRPO, which scores every completion by its reward alone.
"""

from __future__ import annotations

import dataclasses

from grpo_cli.rewards.outcome import length_penalty
from grpo_cli.rewards.result import RewardResult


def _with_steps(result: RewardResult, steps: list[list[tuple[int, float]]], **changes) -> RewardResult:
    """`result` with new `steps` (per completion) and each reward re-summed from them (None: no step)."""
    rewards = [sum(r for _, r in s) if s else None for s in steps]
    return dataclasses.replace(result, rewards=rewards, steps=steps, **changes)


def _with_turns(result: RewardResult, turns: list[list[float | None]], **changes) -> RewardResult:
    """`result` with new per-turn rewards and each episode's reward re-summed from them (None: no turn scored)."""
    rewards = [sum(r for r in t if r is not None) if any(r is not None for r in t) else None for t in turns]
    return dataclasses.replace(result, rewards=rewards, turns=turns, **changes)


def floor_truncated(result: RewardResult, truncated: list[bool], completions: list[str],
                    value: float | None) -> RewardResult:
    """`result` with every truncated completion's reward set to `value` (None: `result` as it is).

    Outcome: the reward is `value`. Process: the steps become one step of reward `value` at the last scored
    step's end (or the completion's end when none was scored), so the process advantage gives every token
    of it the same, lowest return. `per_function` keeps the model's raw scores, for the metrics.
    """
    if value is None or not any(truncated):
        return result
    if result.turns is not None:  # per-turn: the cut episode's last turn scores `value`, its earlier turns nothing
        return _with_turns(result, [[None] * (len(t) - 1) + [value] if cut else t
                                    for t, cut in zip(result.turns, truncated, strict=True)])
    if result.steps is None:
        rewards = [value if cut else r for r, cut in zip(result.rewards, truncated, strict=True)]
        return dataclasses.replace(result, rewards=rewards)
    steps = [s if not cut else [(s[-1][0] if s else len(c), value)] if s or c else []
             for s, cut, c in zip(result.steps, truncated, completions, strict=True)]
    return _with_steps(result, steps)


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
    per_function = {**result.per_function, "overlong": shaped}
    if result.turns is not None:  # per-turn: added to the last turn's reward (an unscored one scores it alone)
        return _with_turns(result, [t[:-1] + [(t[-1] or 0.0) + p] if t and p is not None else t
                                    for t, p in zip(result.turns, shaped, strict=True)], per_function=per_function)
    if result.steps is None:
        rewards = [r if r is None or p is None else r + p for r, p in zip(result.rewards, shaped)]
        return dataclasses.replace(result, rewards=rewards, per_function=per_function)
    steps = [s[:-1] + [(s[-1][0], s[-1][1] + p)] if s and p is not None else s for s, p in zip(result.steps, shaped)]
    return _with_steps(result, steps, per_function=per_function)


def overlong_lengths(rollout, max_new_tokens: int, max_episode_tokens: int | None) -> tuple[list[int], int]:
    """(each row's length L, the cap L_max) the overlong ramp runs against: the budget that cuts the row. A completion:
    its sampled tokens against sampler.max_new_tokens. An episode (`rollout.episodes`): every token after the
    prompt, sampled or added by its environment, against env.max_episode_tokens, which ends it there (an episode
    does not read sampler.max_new_tokens)."""
    if rollout.episodes is None:
        return rollout.lengths, max_new_tokens
    return rollout.completion_mask.sum(1).tolist(), max_episode_tokens


def shape(result: RewardResult, *, lengths: list[int], truncated: list[bool], completions: list[str],
          max_length: int, overlong_buffer: int | None, overlong_penalty: float,
          truncated_reward: float | None) -> RewardResult:
    """Both shapings in the trainer's order: the truncation floor, then the overlong penalty on top of it."""
    floored = floor_truncated(result, truncated, completions, truncated_reward)
    return overlong_shaping(floored, lengths, max_length, overlong_buffer, overlong_penalty)
