"""config.ALGO: the algo section's checks, each error one line that names the fix, before any model loads."""

from __future__ import annotations

import pytest

from grpo_cli.config import compose, validate
from grpo_cli.errors import ConfigError


def errors(*overrides: str) -> list[str]:
    try:
        validate(compose("train", list(overrides)))
    except ConfigError as err:
        return str(err).splitlines()
    return []


@pytest.mark.parametrize("overrides", [["algo.loss_type=cispo"], ["algo.loss_type=sapo"], ["algo.loss_type=gmpo"],
                                       ["algo=gmpo"], ["algo.loss_type=cispo", "algo.cispo_cap=2"]])
def test_the_loss_variants_compose_and_build_their_loss(overrides):
    assert errors(*overrides) == []
    algo = compose("train", overrides).algo
    # the loss node passes the variant's settings through (GRPOLoss reads only those of its loss_type)
    assert (algo.loss.cispo_cap, algo.loss.sapo_temperature_neg) == (algo.cispo_cap, algo.sapo_temperature_neg)


def test_gmpo_preset_is_the_papers_clip_range():
    algo = compose("train", ["algo=gmpo"]).algo
    assert (algo.loss_type, algo.epsilon_low, algo.epsilon_high) == ("gmpo", 0.4, 0.4)


@pytest.mark.parametrize("overrides,line", [
    (["algo.loss_type=cispo", "algo.epsilon_high=5"],
     "algo.epsilon_high (5) is not read by loss_type=cispo (it has no clip; its settings are algo.cispo_cap): "
     "set algo.epsilon_high=null"),
    (["algo.loss_type=sapo", "algo.epsilon_high=0.28"],
     "algo.epsilon_high (0.28) is not read by loss_type=sapo (it has no clip; its settings are "
     "algo.sapo_temperature_pos, algo.sapo_temperature_neg): set algo.epsilon_high=null"),
    (["algo=gmpo", "algo.importance_sampling_level=sequence"],
     "algo.importance_sampling_level (sequence) cannot be used with loss_type=gmpo, which makes its own sequence "
     "ratio from the token ratios: set algo.importance_sampling_level=token"),
    (["algo.cispo_cap=0.2"],
     "algo.cispo_cap (0.2) must be >= 1: an on-policy token's weight is 1 (ScaleRL's ε_max; TRL suggests 5); "
     "set algo.cispo_cap=5"),
    (["algo.sapo_temperature_neg=0"],
     "algo.sapo_temperature_neg (0) must be > 0: the soft gate's temperature; set algo.sapo_temperature_neg=1.05"),
    (["algo.advantage=rloo"],
     "algo.advantage_scale (group) cannot be used with algo.advantage=rloo, which divides by no std (divided by one "
     "it is GRPO's advantage times G/(G-1)): set algo.advantage_scale=none, or use algo=rloo"),
    (["algo.advantage=rloo", "algo.advantage_scale=batch"],
     "algo.advantage_scale (batch) cannot be used with algo.advantage=rloo, which divides by no std (divided by one "
     "it is GRPO's advantage times G/(G-1)): set algo.advantage_scale=none, or use algo=rloo"),
    (["algo.advantage=loo"], "algo.advantage ('loo') must be grpo or rloo; set algo.advantage=grpo"),
])
def test_a_setting_the_loss_type_does_not_read_is_refused(overrides, line):
    assert errors(*overrides) == [line]


@pytest.mark.parametrize("overrides", [["algo=rloo"], ["algo.advantage=rloo", "algo.advantage_scale=none"]])
def test_rloo_composes_without_a_std(overrides):
    assert errors(*overrides) == []
    algo = compose("train", overrides).algo
    assert (algo.advantage, algo.advantage_scale) == ("rloo", "none")


@pytest.mark.parametrize("reward", [["reward=multistep_process", "data=multistep"],
                                    ["reward=prm", "reward.name_or_path=org/prm"]])
def test_rloo_with_step_rewards_alone_is_refused(reward):
    # step rewards are normalized as in the paper whatever algo.advantage says: rloo would change nothing
    assert errors(*reward, "algo=rloo") == [
        f"algo.advantage (rloo) sets the baseline of outcome rewards, and reward "
        f"({compose('train', reward).reward._target_}) gives step rewards alone: set algo.advantage=grpo, or "
        f"reward.process_weight (e.g. 1.0) to add an outcome half that takes it"]
    # with an outcome half (process_weight) the outcome rewards take RLOO's baseline
    if reward[0] == "reward=multistep_process":
        assert errors(*reward, "algo=rloo", "reward.process_weight=1.0") == []
        assert len(errors(*reward, "algo=rloo", "reward.process_weight=inf")) == 1   # inf: step rewards alone
