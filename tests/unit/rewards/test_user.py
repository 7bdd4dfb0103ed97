"""User reward functions as TRL's GRPOTrainer runs them (grpo_cli/rewards/user.py), built from conf/reward/custom.yaml:
math_verify with its defaults, functions that mutate their inputs, TRL's own keyword arguments."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from grpo_cli.errors import ConfigError
from grpo_cli.instantiate import build
from grpo_cli.resources import CONF_DIR
from grpo_cli.rewards.call import check_columns


def custom(tmp_path: Path, *funcs: str, **overrides):
    """reward=custom as conf/reward/custom.yaml builds it, the functions from `tmp_path`/rewards.py."""
    section = OmegaConf.merge(OmegaConf.load(CONF_DIR / "reward" / "custom.yaml"),
                              {"funcs": [f"{tmp_path}/rewards.py:{f}" for f in funcs], **overrides})
    return build(section)


def test_a_function_that_takes_trainer_state_is_told_it_is_not_passed(tmp_path):
    (tmp_path / "rewards.py").write_text("def scheduled(prompts, completions, trainer_state, **kwargs):\n"
                                         "    return [trainer_state.global_step / 100] * len(completions)\n")
    with pytest.raises(ConfigError) as err:
        check_columns(custom(tmp_path, "scheduled"), {"question": "q", "prompt": "q", "answer": "1"})
    line = str(err.value)
    assert "takes trainer_state, TRL's TrainerState (global_step, max_steps, ...), which grpo does not" in line
    assert "trainer_state=None" in line and "add that column" not in line and "\n" not in line
