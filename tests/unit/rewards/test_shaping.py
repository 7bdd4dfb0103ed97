"""Reward shaping (grpo_cli.rewards.shaping): the truncation floor and DAPO's overlong penalty, by hand."""

from __future__ import annotations

import torch
from omegaconf import OmegaConf

from grpo_cli.algo import CHECKS
from grpo_cli.rewards import RewardResult
from grpo_cli.rewards.shaping import floor_truncated, overlong_lengths, overlong_shaping, shape
from grpo_cli.rollout import Rollout


def test_truncated_completions_score_lowest_by_hand():
    # outcome: model scores .2 .9 .4 .7, the 2nd and 4th cut at the cap -> .2 0 .4 0 with a floor of 0: both
    # truncated ones below every finished one, whatever the model thought of them
    scores = RewardResult(rewards=[0.2, 0.9, 0.4, 0.7], per_function={"orm": [0.2, 0.9, 0.4, 0.7]})
    floored = floor_truncated(scores, [False, True, False, True], ["a", "bb", "c", "dd"], 0.0)
    assert floored.rewards == [0.2, 0.0, 0.4, 0.0]
    assert floored.per_function == {"orm": [0.2, 0.9, 0.4, 0.7]}  # the model's own scores stay for the metrics
    assert floor_truncated(scores, [False] * 4, ["a"] * 4, 0.0) is scores  # nothing cut: as it was
    assert floor_truncated(scores, [True] * 4, ["a"] * 4, None) is scores  # off
    # process: steps (3, .9) (6, .8) = 1.7 and (2, .1) = .1; the first is cut -> one step (6, -1) = -1, the
    # lowest; a cut completion with no scored step gets one at its end, (4, -1)
    steps = RewardResult(rewards=[1.7, 0.1, None], per_function={"steps": [0.85, 0.1, None]},
                         steps=[[(3, 0.9), (6, 0.8)], [(2, 0.1)], []])
    floored = floor_truncated(steps, [True, False, True], ["abcdef", "ab", "abcd"], -1.0)
    assert floored.steps == [[(6, -1.0)], [(2, 0.1)], [(4, -1.0)]] and floored.rewards == [-1.0, 0.1, -1.0]


def test_overlong_shaping_adds_dapos_penalty_to_any_reward():
    # L_max 8 (sampler.max_new_tokens), buffer 4, penalty 2: free up to 4 tokens, then -2/4 = -0.5 a token
    lengths = [3, 4, 6, 8]
    # 3, 4 -> 0; 6 -> (4 - 6)/4 · 2 = -1.0; 8 = the cap -> -2.0
    outcome = RewardResult(rewards=[1.0, None, 1.0, 0.5], per_function={"accuracy": [1.0, None, 1.0, 0.5]})
    shaped = overlong_shaping(outcome, lengths, max_length=8, buffer=4, penalty=2.0)
    # a completion without a score keeps none; the raw function scores are unchanged
    assert shaped.rewards == [1.0, None, 0.0, -1.5]
    assert shaped.per_function == {"accuracy": [1.0, None, 1.0, 0.5], "overlong": [0.0, 0.0, -1.0, -2.0]}
    assert overlong_shaping(outcome, lengths, 8, None) is outcome  # off
    # process: onto the last step's reward; a completion with no step has none to shape
    process = RewardResult(rewards=[2.0, None, 1.0, 0.0], per_function={"steps": [1.0, None, 1.0, 0.0]},
                           steps=[[(3, 1.0), (9, 1.0)], [], [(5, 1.0)], [(2, 0.5), (4, -0.5)]])
    shaped = overlong_shaping(process, lengths, max_length=8, buffer=4, penalty=2.0)
    assert shaped.steps == [[(3, 1.0), (9, 1.0)], [], [(5, 0.0)], [(2, 0.5), (4, -2.5)]]
    assert shaped.rewards == [2.0, None, 0.0, -2.0]  # each the sum of its steps


def test_shape_floors_then_penalizes_as_the_trainer_does():
    # floor 0 on the cut 2nd completion, then L_max 8, buffer 4, penalty 1: lengths 3 -> 0, 8 -> -1
    # -> rewards .5 and 0 + -1 = -1 (the penalty lands on the floor, not on the model's .9)
    result = RewardResult(rewards=[0.5, 0.9], per_function={"orm": [0.5, 0.9]})
    shaped = shape(result, lengths=[3, 8], truncated=[False, True], completions=["a", "bb"], max_length=8,
                   overlong_buffer=4, overlong_penalty=1.0, truncated_reward=0.0)
    assert shaped.rewards == [0.5, -1.0]
    assert shaped.per_function == {"orm": [0.5, 0.9], "overlong": [0.0, -1.0]}
    # the same as the two transforms one after the other
    floored = floor_truncated(result, [False, True], ["a", "bb"], 0.0)
    assert overlong_shaping(floored, [3, 8], 8, 4, 1.0) == shaped


def test_per_turn_rewards_are_floored_and_penalized_on_the_last_turn():
    # episodes of 2, 1 and 2 turns scored per turn: (1, .5) = 1.5, (2) = 2, (None, 1) = 1
    turns = RewardResult(rewards=[1.5, 2.0, 1.0], per_function={"t": [1.5, 2.0, 1.0]},
                         turns=[[1.0, 0.5], [2.0], [None, 1.0]])
    # the first is cut by the episode's budget: its last turn scores the floor -1, its earlier turns nothing
    floored = floor_truncated(turns, [True, False, False], ["x", "y", "z"], -1.0)
    assert floored.turns == [[None, -1.0], [2.0], [None, 1.0]] and floored.rewards == [-1.0, 2.0, 1.0]
    # DAPO's penalty (L_max 10, buffer 4): lengths 8 -> -(8 - 6) / 4 = -0.5 and 10 -> -1, on the last turn
    shaped = overlong_shaping(turns, [8, 3, 10], 10, 4)
    assert shaped.turns == [[1.0, 0.0], [2.0], [None, 0.0]] and shaped.rewards == [1.0, 2.0, 0.0]


def test_an_episodes_ramp_counts_every_token_after_the_prompt_against_its_budget():
    # two episodes, env.max_episode_tokens 40, sampler.max_new_tokens 8 (which episodes do not read):
    #   row 0: 6 sampled, 30 added by the environment (a tool result), 2 sampled = 38 tokens, 8 of them sampled
    #   row 1: 4 sampled = 4 tokens
    sampled = torch.tensor([[1] * 6 + [0] * 30 + [1] * 2, [1] * 4 + [0] * 34])
    mask = torch.tensor([[1] * 38, [1] * 4 + [0] * 34])
    episodes = Rollout(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long),
                       torch.zeros(2, 38, dtype=torch.long), mask, ["a", "b"], [False, False],
                       sampled_mask=sampled, episodes=[object(), object()])
    assert episodes.lengths == [8, 4]  # what the loss counts: the sampled tokens
    lengths, cap = overlong_lengths(episodes, max_new_tokens=8, max_episode_tokens=40)
    assert (lengths, cap) == ([38, 4], 40)
    # buffer 4: free up to 40 - 4 = 36 tokens; 38 -> -(38 - 36) / 4 = -0.5; 4 -> 0
    # (against max_new_tokens 8 with the sampled 8 it was -(8 - 4) / 4 = -1: a cut-off without the cut)
    shaped = overlong_shaping(RewardResult(rewards=[1.0, 1.0], per_function={}), lengths, cap, buffer=4)
    assert shaped.rewards == [0.5, 1.0]
    # plain completions: the sampled tokens against sampler.max_new_tokens, the budget that cuts them
    plain = Rollout(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long),
                    torch.zeros(2, 8, dtype=torch.long), torch.tensor([[1] * 8, [1] * 3 + [0] * 5]), ["a", "b"],
                    [True, False])
    assert overlong_lengths(plain, max_new_tokens=8, max_episode_tokens=40) == ([8, 3], 8)


def shaping_problems(**sections) -> list[str]:
    cfg = OmegaConf.create(sections)
    return [line for check in CHECKS for line in (check(cfg) if callable(check) else [])]


def test_the_buffer_must_fit_the_budget_the_ramp_runs_against():
    algo = {"overlong_buffer": 20, "overlong_penalty": 1.0}
    tools = {"_target_": "grpo_cli.env.ToolsEnv", "max_episode_tokens": 40}
    # an episode's budget is env.max_episode_tokens: a buffer of 20 fits 40, whatever sampler.max_new_tokens says
    assert shaping_problems(algo=algo, sampler={"max_new_tokens": 8}, env=tools) == []
    assert shaping_problems(algo={**algo, "overlong_buffer": 50}, sampler={"max_new_tokens": 64}, env=tools) == [
        "algo.overlong_buffer (50) must be at most env.max_episode_tokens (40): the penalty ramps over the last "
        "overlong_buffer tokens before the cap; set algo.overlong_buffer=10"]
    # no environment (env=none): sampler.max_new_tokens, as before
    assert shaping_problems(algo=algo, sampler={"max_new_tokens": 8}, env={"_target_": None}) == [
        "algo.overlong_buffer (20) must be at most sampler.max_new_tokens (8): the penalty ramps over the last "
        "overlong_buffer tokens before the cap; set algo.overlong_buffer=2"]
