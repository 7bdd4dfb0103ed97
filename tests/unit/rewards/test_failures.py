"""A reward function that raises or calls sys.exit() is a failed reward (its scores None, the run goes on); Ctrl-C
and config errors pass through."""

from __future__ import annotations

import logging
import sys

import pytest

from grpo_cli.errors import ConfigError
from grpo_cli.rewards import OutcomeReward


def exits(prompts, completions, **_):
    """A reward function whose library calls sys.exit() on odd input."""
    if any("bad" in c for c in completions):
        sys.exit(3)
    return [1.0] * len(completions)


@pytest.mark.parametrize("timeout_s", [None, 5.0], ids=["inline", "worker-thread"])
def test_system_exit_in_a_reward_is_a_failure(timeout_s, caplog):
    reward = OutcomeReward({"exits": exits}, weights=None, timeout_s=timeout_s, worker="process")
    with caplog.at_level(logging.WARNING, logger="grpo_cli.rewards"):
        result = reward(["p"] * 3, ["good", "bad", "good"], {})
    # the batch call exits; retried one by one, only "bad" loses its score
    assert result.rewards == [1.0, None, 1.0] and result.failures == 1
    assert ["SystemExit(3)" in r.getMessage() for r in caplog.records] == [True]


@pytest.mark.parametrize("timeout_s", [None, 5.0], ids=["inline", "worker-thread"])
def test_system_exit_on_every_completion(timeout_s):
    def always(prompts, completions, **_):
        raise SystemExit

    reward = OutcomeReward({"always": always}, weights=None, timeout_s=timeout_s, worker="process")
    assert reward(["p", "p"], ["x", "y"], {}).rewards == [None, None]


def test_ctrl_c_and_config_errors_still_pass_through():
    def interrupted(prompts, completions, **_):
        raise KeyboardInterrupt

    def misconfigured(prompts, completions, **_):
        raise ConfigError("reward.functions.x.pattern is broken; fix it")

    with pytest.raises(KeyboardInterrupt):
        OutcomeReward({"i": interrupted}, weights=None, timeout_s=None, worker="process")(["p"], ["x"], {})
    with pytest.raises(ConfigError, match="pattern is broken"):
        OutcomeReward({"m": misconfigured}, weights=None, timeout_s=5.0, worker="process")(["p"], ["x"], {})
