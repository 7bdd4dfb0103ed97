"""The `algo` section: every check of its settings, the loss settings read once, and the loss built from them.

    loss = build_loss(cfg.algo)          # the class algo.loss names, built with loss_settings(cfg.algo)

- `CHECKS`: each `algo.*` setting's check (collected by config.validate; grpo_cli.checks says how a check reads):
  the loss settings' (`LOSS_CHECKS`, one per `LossSettings` field), the group's and the advantage's, dynamic
  sampling's (grpo_cli.groups) and the overlong penalty's (grpo_cli.rewards.shaping), and those of two settings
  that must agree.
- `loss_settings(algo)`: the `LossSettings` record of the section; its fields are the keys that are loss settings,
  named once in grpo_cli/objective/settings.py. objective/ takes that record and scalars, never a config.
- `upgrade_loss_node(cfg)`: a run saved when `algo.loss` listed the loss settings as its own keys, made to resume
  (runs.upgrade calls it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from grpo_cli.checks import Check, Rule, get, is_int, is_num, one_of
from grpo_cli.instantiate import build
from grpo_cli.objective import (
    ESTIMATORS,
    IMPORTANCE_SAMPLING_LEVELS,
    IS_CORRECTIONS,
    KL_ESTIMATORS,
    LOSS_SETTINGS,
    LOSS_TYPES,
    MASK_MODES,
    SCALES,
    STDS,
    SURROGATES,
    UNSCALED_ESTIMATORS,
    Loss,
    LossSettings,
)

# ---- the loss settings ------------------------------------------------------------------------------------------

# each loss setting's check, (ok, fix), by its LossSettings field: LOSS_CHECKS makes one Rule per field, so a field
# added without a check here stops the import
LOSS_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "beta": (lambda v: is_num(v) and v >= 0, "must be >= 0 (0 turns the KL term off); set algo.beta=0.04"),
    "epsilon_low": (lambda v: is_num(v) and 0 < v < 1, "must be in (0, 1); set algo.epsilon_low=0.2"),
    "epsilon_high": (lambda v: v is None or (is_num(v) and v > 0),
                     "must be > 0 or null (null: same as epsilon_low); set algo.epsilon_high=null"),
    "kl_estimator": (lambda v: v in KL_ESTIMATORS, f"must be {one_of(KL_ESTIMATORS)}; set algo.kl_estimator=k3"),
    "loss_type": (lambda v: v in LOSS_TYPES, f"must be {one_of(LOSS_TYPES)}; set algo.loss_type=grpo"),
    "importance_sampling_level": (
        lambda v: v in IMPORTANCE_SAMPLING_LEVELS,
        f"must be {one_of(IMPORTANCE_SAMPLING_LEVELS)} (sequence: GSPO, or algo=gspo with its clip range); "
        f"set algo.importance_sampling_level=token"),
    "is_correction_cap": (
        lambda v: v is None or (is_num(v) and v >= 1),
        "must be >= 1 or null (off): the weight of a token both engines agree on is 1; set algo.is_correction_cap=2"),
    "is_correction": (lambda v: v in IS_CORRECTIONS,
                      f"must be {one_of(IS_CORRECTIONS)}; set algo.is_correction=token_truncate"),
    "is_correction_min": (lambda v: v is None or (is_num(v) and 0 < v <= 1),
                          "must be in (0, 1] or null (null: 1/is_correction_cap); set algo.is_correction_min=null"),
    "entropy_coef": (lambda v: is_num(v) and math.isfinite(v),
                     "must be a number (0: off; verl uses ~1e-3); set algo.entropy_coef=0.0"),
    "top_entropy_quantile": (
        lambda v: is_num(v) and 0 < v <= 1,
        "must be in (0, 1]: the share of highest-entropy tokens that carry the policy gradient (1.0: all; the "
        "paper keeps 0.2); set algo.top_entropy_quantile=1.0"),
    "cispo_cap": (lambda v: is_num(v) and v >= 1,
                  "must be >= 1: an on-policy token's weight is 1 (ScaleRL's ε_max; TRL suggests 5); set "
                  "algo.cispo_cap=5"),
    "sapo_temperature_pos": (lambda v: is_num(v) and v > 0,
                             "must be > 0: the soft gate's temperature; set algo.sapo_temperature_pos=1.0"),
    "sapo_temperature_neg": (lambda v: is_num(v) and v > 0,
                             "must be > 0: the soft gate's temperature; set algo.sapo_temperature_neg=1.05"),
}
LOSS_CHECKS: list[Check] = [Rule(f"algo.{name}", *LOSS_RULES[name]) for name in LOSS_SETTINGS]


def loss_settings(algo: DictConfig | dict) -> LossSettings:
    """The loss's settings, read once from the algo section (a run saved before one of them existed has it from
    runs.upgrade)."""
    return LossSettings(**{name: algo[name] for name in LOSS_SETTINGS})


def build_loss(algo: DictConfig, **changes: Any) -> Loss:
    """The loss the `algo.loss` node's `_target_` names, built with `loss_settings(algo)` and any `changes` of them
    (LossSettings field -> value)."""
    return build(algo.loss, _partial_=True)(dataclasses.replace(loss_settings(algo), **changes))


def upgrade_loss_node(cfg: DictConfig) -> DictConfig:
    """`cfg` (a saved run's config) with its `algo.loss` node naming its class alone, as the node does now.

    A run saved before the loss settings were read from `algo` itself listed them in that node, handed on from
    the section (`beta: ${..beta}`, saved resolved); a value set on the node alone (`algo.loss.beta=...`) is what
    that run trained with, so each one moves up to `algo`, where `loss_settings` reads it."""
    node = OmegaConf.select(cfg, "algo.loss", default=None)
    listed = [k for k in node if k in LOSS_SETTINGS] if isinstance(node, DictConfig) else []
    if not listed:
        return cfg
    cfg = cfg.copy()
    with open_dict(cfg):
        for key in listed:
            cfg.algo[key] = cfg.algo.loss.pop(key)
    return cfg


# ---- the rest of the section's checks ------------------------------------------------------------------------------

def _check_unscaled_advantage(algo) -> list[str]:
    """RLOO's advantage divides by no std: divided by one it would be GRPO's times G/(G-1), a learning rate change."""
    if algo is None or algo.get("advantage") not in UNSCALED_ESTIMATORS or algo.get("advantage_scale") == "none":
        return []
    return [f"algo.advantage_scale ({algo.advantage_scale}) cannot be used with algo.advantage={algo.advantage}, "
            f"which divides by no std (divided by one it is GRPO's advantage times G/(G-1)): set "
            f"algo.advantage_scale=none, or use algo={algo.advantage}"]


# the rewards whose step rewards make process advantages, normalized as in the paper (grpo_cli.credit); with
# reward.process_weight their outcome half takes algo.advantage
PROCESS_REWARDS = ("grpo_cli.rewards.ProcessReward", "grpo_cli.rewards.models.process_reward_model")


def _check_advantage_of_step_rewards(algo, reward) -> list[str]:
    """An advantage estimator other than GRPO's is the outcome rewards' baseline: with step rewards alone it does
    nothing, so say so rather than train as if it were set."""
    if algo is None or algo.get("advantage") in (None, "grpo") or reward is None:
        return []
    weight = reward.get("process_weight")   # None or inf: the step rewards alone (ProcessReward)
    if reward.get("_target_") not in PROCESS_REWARDS or (is_num(weight) and math.isfinite(weight)):
        return []
    return [f"algo.advantage ({algo.advantage}) sets the baseline of outcome rewards, and reward ({reward._target_}) "
            f"gives step rewards alone: set algo.advantage=grpo, or reward.process_weight (e.g. 1.0) to add an "
            f"outcome half that takes it"]


def _check_credit_of_outcome_rewards(reward) -> list[str]:
    """reward.credit gathers step rewards into a token's return: a reward of one score per completion has no steps
    to gather, and would train as if it were not set."""
    if reward is None or "credit" not in reward or reward.get("_target_") in PROCESS_REWARDS:
        return []
    return [f"reward.credit ({reward.credit}) gathers step rewards, and reward ({reward.get('_target_')}) gives one "
            f"reward per completion: use a process reward (reward=multistep_process, gsm8k_process or prm) or remove "
            f"reward.credit"]


def _check_loss_variant(algo) -> list[str]:
    """A loss_type with a term of its own reads no clip range (cispo, sapo) or makes its own ratio (gmpo): a value
    set for what it does not read is a mistake (TRL's epsilon_high is CISPO's cap; here that is algo.cispo_cap)."""
    surrogate = SURROGATES.get(algo.get("loss_type")) if algo is not None else None
    if surrogate is None:
        return []
    errors = []
    if algo.get("epsilon_high") is not None and "epsilon_high" not in surrogate.reads:
        instead = ", ".join(f"algo.{k}" for k in surrogate.reads)
        errors.append(f"algo.epsilon_high ({algo.epsilon_high}) is not read by loss_type={algo.loss_type} (it has no "
                      f"clip; its settings are {instead}): set algo.epsilon_high=null")
    if surrogate.own_ratio and algo.get("importance_sampling_level") not in (None, "token"):
        errors.append(f"algo.importance_sampling_level ({algo.importance_sampling_level}) cannot be used with "
                      f"loss_type={algo.loss_type}, which makes its own sequence ratio from the token ratios: "
                      f"set algo.importance_sampling_level=token")
    return errors


def _check_is_correction(algo) -> list[str]:
    """An IS mode other than the default does nothing without a cap, and a lower bound nothing in a truncate mode:
    say so rather than run without them."""
    if algo is None:
        return []
    if algo.get("is_correction_min") is not None and algo.get("is_correction") not in MASK_MODES:
        return [f"algo.is_correction_min ({algo.is_correction_min}) is read only by algo.is_correction="
                f"{' or '.join(MASK_MODES)} (truncation lowers the high weights only): set "
                f"algo.is_correction_min=null, or algo.is_correction=token_mask"]
    if algo.get("is_correction") not in IS_CORRECTIONS or algo.is_correction == "token_truncate":
        return []
    if algo.get("is_correction_cap") is None:
        return [f"algo.is_correction ({algo.is_correction}) needs a cap: set algo.is_correction_cap (a sequence "
                f"cap is larger than a token one, e.g. 5; verl suggests 2-10), or algo.is_correction=token_truncate"]
    return []


def _check_overlong(cfg) -> list[str]:
    """The buffer lies inside the budget the ramp runs against (eq. 13 needs L_cache <= L_max): an episode's
    env.max_episode_tokens, else sampler.max_new_tokens (`rewards.shaping.overlong_lengths`)."""
    key = "env.max_episode_tokens" if get(cfg, "env._target_")[1] else "sampler.max_new_tokens"
    buffer, budget = get(cfg, "algo.overlong_buffer")[1], get(cfg, key)[1]
    if is_int(buffer) and is_int(budget) and buffer > budget >= 1:  # buffer < 1 has its own line
        fit = max(1, budget // 4)
        return [f"algo.overlong_buffer ({buffer}) must be at most {key} ({budget}): the penalty ramps over the last "
                f"overlong_buffer tokens before the cap; set algo.overlong_buffer={fit}"]
    return []


def _check_staleness(cfg) -> list[str]:
    """Rollouts ahead of the update (rollout/ahead.py) need a sampler that holds its own weights in another process,
    and steps whose prompts are known in advance: one draw each, single-turn, one reward model for the run."""
    k = get(cfg, "algo.max_staleness")[1]
    if not is_int(k) or k < 1:
        return []
    fix = "or set algo.max_staleness=0"
    needs = [(not str(get(cfg, "sampler._target_")[1]).endswith(".VLLMServerSampler"),
              "samples from a vLLM server while the trainer updates: set sampler=vllm_server"),
             (get(cfg, "algo.dynamic_sampling")[1] is True,
              "needs each step's prompts in advance, and dynamic sampling draws until enough groups vary: set "
              "algo.dynamic_sampling=false"),
             (bool(get(cfg, "env._target_")[1]), "samples single-turn completions: set env=none"),
             (bool(get(cfg, "iterative.iterations")[1]),
              "keeps one reward for the run, and iterative RL retrains it: set iterative.iterations=0")]
    return [f"algo.max_staleness ({k}) {why}, {fix}" for bad, why in needs if bad]


CHECKS: list[Check] = [
    Rule("algo.max_staleness", lambda v: is_int(v) and v >= 0,
         "must be an integer >= 0 (0: synchronous); set algo.max_staleness=0"),
    _check_staleness,
    Rule("algo.group_size", lambda v: is_int(v) and v >= 2,
         "must be an integer >= 2: GRPO normalizes rewards within a group; set algo.group_size=8"),
    Rule("algo.num_iterations", lambda v: is_int(v) and v >= 1, "must be an integer >= 1; set algo.num_iterations=1"),
    *LOSS_CHECKS,
    Rule("algo.advantage_scale", lambda v: v in SCALES, f"must be {one_of(SCALES)}; set algo.advantage_scale=group"),
    Rule("algo.advantage_std", lambda v: v in STDS, f"must be {one_of(STDS)}; set algo.advantage_std=population"),
    Rule("algo.advantage", lambda v: v in ESTIMATORS, f"must be {one_of(ESTIMATORS)}; set algo.advantage=grpo"),
    lambda cfg: _check_unscaled_advantage(cfg.get("algo")),
    lambda cfg: _check_advantage_of_step_rewards(cfg.get("algo"), cfg.get("reward")),
    lambda cfg: _check_credit_of_outcome_rewards(cfg.get("reward")),
    lambda cfg: _check_is_correction(cfg.get("algo")),
    lambda cfg: _check_loss_variant(cfg.get("algo")),
    # dynamic sampling (grpo_cli.groups)
    Rule("algo.dynamic_sampling", lambda v: isinstance(v, bool),
         "must be true or false; set algo.dynamic_sampling=false"),
    Rule("algo.filter_metric", lambda v: isinstance(v, str) and bool(v),
         "must name a reward function (rewards/<name>/mean in metrics.jsonl) or reward; set "
         "algo.filter_metric=accuracy"),
    Rule("algo.max_generation_batches", lambda v: is_int(v) and v >= 1,
         "must be an integer >= 1 (draws of prompts_per_step prompts a step); set algo.max_generation_batches=3"),
    # DAPO's overlong penalty (grpo_cli.rewards.shaping)
    Rule("algo.overlong_buffer", lambda v: v is None or (is_int(v) and v >= 1),
         "must be an integer >= 1 (tokens before sampler.max_new_tokens) or null (off); "
         "set algo.overlong_buffer=null"),
    Rule("algo.overlong_penalty", lambda v: is_num(v) and v >= 0,
         "must be a number >= 0 (DAPO's is 1); set algo.overlong_penalty=1.0"),
    _check_overlong,
]
