"""grpo_cli.checks: no range check lets inf or nan through. YAML and Hydra's command line read `inf`, `.inf` and `nan`
as floats, and a non-finite value passed a `> 0` check, so the run loaded the model and then died in a join or a poll
(OverflowError) or trained on nonsense."""

from __future__ import annotations

import math

import pytest
from omegaconf import OmegaConf

from grpo_cli import config
from grpo_cli.checks import Rule, is_num
from grpo_cli.commands import evaluate, rm, sample, train
from grpo_cli.config import compose, validate
from grpo_cli.errors import ConfigError

RULES = [c for c in (*config.LIBRARY_CHECKS, *train.CHECKS, *evaluate.CHECKS, *sample.CHECKS, *rm.CHECKS)
         if isinstance(c, Rule)]
# the one number a rule takes as infinite on purpose: a process reward's λ = inf is "step rewards alone", as null
# (grpo_cli.rewards.combine.ProcessReward)
INFINITE_ON_PURPOSE = {("reward.process_weight", math.inf)}


def test_is_num_is_a_finite_number():
    assert [is_num(v) for v in (0, -3, 2.5, 1e308)] == [True] * 4
    assert [is_num(v) for v in (math.inf, -math.inf, math.nan, True, "1", None)] == [False] * 6


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("key", sorted({r.key for r in RULES}))
def test_no_rule_accepts_a_value_that_is_not_finite(key, value):
    if (key, value) in INFINITE_ON_PURPOSE:
        return
    cfg = OmegaConf.create()
    OmegaConf.update(cfg, key, value)
    # a key may have two rules (model.device: a name, then CUDA present): one of them is its range check
    assert [line for rule in RULES if rule.key == key for line in rule(cfg)], f"{key}={value} passed its checks"


def problems(command: str, *overrides: str) -> list[str]:
    checks = {"train": train.CHECKS, "rm": rm.CHECKS}[command]  # as `grpo train` and `grpo rm` validate
    try:
        validate(compose(command, list(overrides)), *checks)
    except ConfigError as err:
        return str(err).splitlines()
    return []


# each key the red-team round set to inf, with the options that give it a home in the composed config
@pytest.mark.parametrize("key, options", [
    ("optimizer.lr", []), ("algo.beta", []), ("model.lora.alpha", []), ("algo.sapo_temperature_pos", []),
    ("algo.overlong_penalty", []), ("reward.timeout_s", ["reward=custom", "reward.funcs=[accuracy]"]),
    ("env.tool_timeout_s", ["env=tools", "env.tools=[grpo_cli.rewards.outcome.accuracy]"]),
    ("reward.functions.judge.timeout_s", ["reward=judge", "reward.functions.judge.model=m"]),
    ("trainer.completions_max_mb", []), ("rm.lr", []),
])
@pytest.mark.parametrize("written", ["inf", "nan"])
def test_inf_or_nan_on_the_command_line_is_one_line_before_the_model_loads(key, options, written):
    command = "rm" if key.startswith("rm.") else "train"
    lines = problems(command, *options, f"{key}={written}")
    ours = [line for line in lines if line.startswith(f"{key} (")]
    assert len(ours) == 1, lines
