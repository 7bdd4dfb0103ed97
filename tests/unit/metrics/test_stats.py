"""grpo_cli.metrics.stats: a step's episode metrics, worked by hand."""

from __future__ import annotations

from types import SimpleNamespace

from grpo_cli.metrics.stats import episode_metrics


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
