"""grpo_cli.metrics.stats: a step's episode metrics and the Wilson interval, worked by hand."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from grpo_cli.metrics.stats import episode_metrics, wilson_interval


def episode(calls: int, failures: int, turns: int, sampled: list[int]):
    return SimpleNamespace(tool_calls=calls, tool_failures=failures, turns=turns, sampled=sampled)


def test_episode_metrics_count_calls_failures_turns_and_environment_tokens():
    episodes = [episode(2, 1, 3, [1, 1, 0, 0, 1, 0, 1]),  # 7 tokens, 3 added by the environment
                episode(0, 0, 1, [1, 1, 1]),  # an answer without a call
                episode(1, 0, 2, [1, 0, 0, 1, 1])]  # 5 tokens, 2 added
    assert episode_metrics(episodes) == {
        "tools/call_frequency": 1.0,  # (2 + 0 + 1) calls / 3 episodes
        "tools/failure_frequency": 1 / 3,  # 1 failed of 3 calls
        "turns/mean": 2.0,  # (3 + 1 + 2) / 3
        "tokens/environment_share": 5 / 15,  # (3 + 0 + 2) added of (7 + 3 + 5) tokens
    }
    # no call at all: no failure share to speak of, 0
    assert episode_metrics([episode(0, 0, 1, [1])])["tools/failure_frequency"] == 0.0


def test_the_wilson_interval_of_an_accuracy():
    # 96 of 200: p = 0.48, z = 1.96; centre (0.48 + z²/400) / (1 + z²/200) = 0.48074,
    # half-width z·sqrt(0.48·0.52/200 + z²/160000) / (1 + z²/200) = 0.06859
    low, high = wilson_interval(96, 200)
    assert (low, high) == (pytest.approx(0.41179, abs=1e-5), pytest.approx(0.54896, abs=1e-5))
    # none right of 10: from 0 (not a rounding error below it) up to z² / (10 + z²) = 3.8416 / 13.8416
    assert wilson_interval(0, 10) == (0.0, pytest.approx(0.27754, abs=1e-5))
    assert wilson_interval(10, 10) == (pytest.approx(0.72246, abs=1e-5), 1.0)
    # no problem scored: no interval
    assert all(math.isnan(v) for v in wilson_interval(0, 0))
