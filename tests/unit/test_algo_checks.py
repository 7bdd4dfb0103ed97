"""grpo_cli/algo.py: the algo section's checks, each error one line that names the fix, before any model loads; the
loss settings read once from the section, and the loss built from them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from omegaconf import OmegaConf, open_dict

from grpo_cli import algo as algo_section
from grpo_cli.algo import build_loss, loss_settings
from grpo_cli.checks import Rule
from grpo_cli.config import LIBRARY_CHECKS, compose, validate
from grpo_cli.errors import ConfigError
from grpo_cli.objective import LOSS_SETTINGS, Loss, LossSettings
from grpo_cli.resources import CONF_DIR
from grpo_cli.runs import resume_config

# the algo section of a run's config.yaml as the commit before LossSettings saved it (its loss node lists the loss
# settings, handed on from algo)
SAVED_ALGO = Path(__file__).parent / "fixtures" / "algo_saved_by_4bfba7f.yaml"


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
    # the loss gets the variant's settings (GRPOLoss reads only those of its loss_type)
    settings = build_loss(algo).settings
    assert (settings.cispo_cap, settings.sapo_temperature_neg) == (algo.cispo_cap, algo.sapo_temperature_neg)


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


def test_the_loss_settings_are_read_once_from_the_algo_section():
    algo = compose("train", ["algo.loss_type=cispo", "algo.cispo_cap=2", "algo.beta=0", "algo.entropy_coef=0.01"]).algo
    settings = loss_settings(algo)
    assert settings == LossSettings(**{name: algo[name] for name in LOSS_SETTINGS})
    assert (settings.loss_type, settings.cispo_cap, settings.beta, settings.entropy_coef) == ("cispo", 2, 0, 0.01)
    # the loss node names its class alone; the class gets the section's settings and declares what it reads
    assert list(algo.loss) == ["_target_"]
    loss = build_loss(algo)
    assert isinstance(loss, Loss) and loss.settings == settings
    assert (loss.needs_reference, loss.needs_entropy, loss.needs_entropy_grad, loss.entropy_quantile) == \
        (False, True, True, None)


def test_each_loss_setting_is_an_algo_key_with_its_check():
    # one name per setting: LossSettings' field is the key of conf/algo/grpo.yaml (its home) and of its Rule
    keys = set(OmegaConf.load(CONF_DIR / "algo" / "grpo.yaml"))
    assert set(LOSS_SETTINGS) <= keys
    assert [c.key for c in algo_section.LOSS_CHECKS] == [f"algo.{name}" for name in LOSS_SETTINGS]


def test_every_algo_check_lives_in_the_algo_module():
    elsewhere = [c.key for c in LIBRARY_CHECKS
                 if isinstance(c, Rule) and c.key.startswith("algo.") and c not in algo_section.CHECKS]
    assert elsewhere == []
    assert all(c in LIBRARY_CHECKS for c in algo_section.CHECKS)


def _saved(algo) -> OmegaConf:
    """Today's composed train config with `algo` as a saved run's section."""
    saved = OmegaConf.create(OmegaConf.to_container(compose("train", ["resume=somewhere"]), resolve=True))
    with open_dict(saved):
        saved.algo = algo
    return saved


def test_a_run_saved_with_the_settings_in_its_loss_node_resumes_with_them():
    algo = OmegaConf.load(SAVED_ALGO).algo
    algo.loss.beta = 0.0  # set on the node alone (algo.loss.beta=0): what that run trained with
    cfg = compose("train", ["resume=somewhere"])
    merged = validate(resume_config(cfg, _saved(algo), overrides=["resume=somewhere"]))
    assert list(merged.algo.loss) == ["_target_"]
    assert build_loss(merged.algo).settings == dataclasses.replace(loss_settings(cfg.algo), beta=0.0)


def test_a_run_saved_before_the_variants_settings_resumes_with_their_yaml_values():
    # saved before cispo_cap and the sapo temperatures existed: absent from its section and its loss node; they take
    # conf/algo/grpo.yaml's values (runs.upgrade), which its loss_type never reads
    algo = OmegaConf.load(SAVED_ALGO).algo
    for key in ("cispo_cap", "sapo_temperature_pos", "sapo_temperature_neg"):
        del algo[key], algo.loss[key]
    merged = validate(resume_config(compose("train", ["resume=somewhere"]), _saved(algo), ["resume=somewhere"]))
    settings = build_loss(merged.algo).settings
    assert (settings.cispo_cap, settings.sapo_temperature_pos, settings.sapo_temperature_neg) == (5.0, 1.0, 1.05)
    assert settings.loss_type == "grpo"


def test_rollouts_ahead_are_refused_where_they_cannot_run():
    """algo.max_staleness > 0 samples from a vLLM server while the trainer updates, with each step's prompts known in
    advance: one line per setting that stands in the way, before anything loads."""
    def lines(*overrides):
        with pytest.raises(ConfigError) as err:
            validate(compose("train", ["algo.max_staleness=1", *overrides]))
        return str(err.value).splitlines()

    assert lines() == ["algo.max_staleness (1) samples from a vLLM server while the trainer updates: set "
                       "sampler=vllm_server, or set algo.max_staleness=0"]
    assert "algo.max_staleness (1) needs each step's prompts in advance, and dynamic sampling draws until enough " \
           "groups vary: set algo.dynamic_sampling=false, or set algo.max_staleness=0" in lines(
               "algo.dynamic_sampling=true")
    with pytest.raises(ConfigError, match=r"algo.max_staleness \(-1\) must be an integer >= 0"):
        validate(compose("train", ["algo.max_staleness=-1"]))
