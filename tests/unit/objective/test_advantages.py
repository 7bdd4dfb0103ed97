"""grpo_cli/objective/advantages.py's estimators beyond GRPO's: RLOO's leave-one-out baseline, worked by hand and
against a plain loop. (GRPO's own outcome and process advantages: tests/unit/test_objective.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from grpo_cli import credit
from grpo_cli.objective import ADVANTAGE_ESTIMATORS, outcome_advantages
from grpo_cli.rewards.result import RewardResult
from grpo_cli.rollout import Rollout


def close(x, expected, tol=1e-9):
    return torch.allclose(torch.as_tensor(x, dtype=torch.float64),
                          torch.as_tensor(expected, dtype=torch.float64), atol=tol, rtol=0)


def test_rloo_by_hand():
    # G = 4, rewards [1, 0, 0, 1]: each minus the mean of the other three
    # 1 - (0 + 0 + 1)/3 = 2/3;  0 - (1 + 0 + 1)/3 = -2/3; no std: GRPO's would be ±1
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    assert close(outcome_advantages(r, 4, estimator="rloo", scale="none"), [2 / 3, -2 / 3, -2 / 3, 2 / 3], tol=1e-6)
    # two groups of G = 2, [0, 2] and [5, 5]: 0 - 2 = -2, 2 - 0 = 2; a tie group gets 0
    r = torch.tensor([0.0, 2.0, 5.0, 5.0])
    assert close(outcome_advantages(r, 2, estimator="rloo", scale="none"), [-2, 2, 0, 0])


def test_rloo_is_the_centered_reward_times_g_over_g_minus_1():
    # r_i - (S - r_i)/(G - 1) = G/(G - 1) · (r_i - mean): Dr. GRPO's unscaled advantage, times G/(G - 1)
    g = torch.Generator().manual_seed(0)
    r = torch.randn(24, generator=g, dtype=torch.float64)
    grpo = outcome_advantages(r, 8, scale="none")
    assert close(outcome_advantages(r, 8, estimator="rloo", scale="none"), grpo * 8 / 7, tol=1e-12)


def test_rloo_without_a_score():
    # [1, NaN, 0, 0]: the scored three leave one out among themselves: 1 - (0 + 0)/2 = 1, 0 - (1 + 0)/2 = -0.5;
    # the unscored one 0. [3, NaN]: one scored reward has no other to compare with -> 0, not NaN
    r = torch.tensor([1.0, math.nan, 0.0, 0.0, 3.0, math.nan, math.nan, math.nan])
    adv = outcome_advantages(r, 4, estimator="rloo", scale="none")
    assert close(adv, [1.0, 0.0, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0])
    adv = outcome_advantages(torch.tensor([3.0, math.nan]), 2, estimator="rloo", scale="none")
    assert close(adv, [0.0, 0.0])


def loop_rloo(rewards, g):
    out = []
    for start in range(0, len(rewards), g):
        group = rewards[start:start + g]
        scored = [x for x in group if not math.isnan(x)]
        for x in group:
            others = len(scored) - 1
            out.append(0.0 if math.isnan(x) or others < 1 else x - (sum(scored) - x) / others)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_rloo_matches_the_loop(seed):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(30, generator=g, dtype=torch.float64)
    r[torch.rand(30, generator=g) < 0.2] = math.nan
    assert close(outcome_advantages(r, 5, estimator="rloo", scale="none"), loop_rloo(r.tolist(), 5), tol=1e-12)


def test_rloo_has_no_std_to_scale_by():
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "rloo"}
    with pytest.raises(ValueError, match=r"estimator 'rloo' divides by no std: pass scale='none'"):
        outcome_advantages(torch.zeros(4), 4, estimator="rloo")
    with pytest.raises(ValueError, match=r"estimator \('ppo'\) must be one of \('grpo', 'rloo'\)"):
        outcome_advantages(torch.zeros(4), 4, estimator="ppo")


def test_the_update_gathers_rloo_advantages():
    # the trainer's path (grpo_cli.credit, as recipe.step calls it with algo.advantage): [1, 0, 0, 1] -> ±2/3
    result = RewardResult(rewards=[1.0, 0.0, 0.0, 1.0], per_function={})
    ones = torch.ones(4, 1, dtype=torch.long)  # a one-token completion per row
    rollout = Rollout(ones, ones, ones, ones, ["a"] * 4, [False] * 4)
    adv = credit.advantages(credit.token_rewards(result, rollout, None), 4, "none", "population", estimator="rloo")
    assert close(adv, [2 / 3, -2 / 3, -2 / 3, 2 / 3], tol=1e-6)
