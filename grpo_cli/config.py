"""The composed config: where the YAML lives, recipe registration, and validation before heavy work.

Every setting has one home, its line in a YAML file under `conf/`; this module holds no defaults.
`validate(cfg)` checks the values a typo or a bad sweep could break, and checks each `_target_`
node's keys against the signature of what it builds (as torchtune does), so a wrong key fails in
milliseconds with a message that names the field and the fix, not after a 20 s model load.
"""

from __future__ import annotations

import difflib
import inspect
import math
from typing import Any

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import get_object
from omegaconf import DictConfig, ListConfig, OmegaConf

from grpo_cli import env, groups, iterative, policy, rewards, rollout
from grpo_cli.checks import Check, Rule, is_int, is_num, one_of
from grpo_cli.errors import ConfigError
from grpo_cli.objective import (
    ESTIMATORS,
    IMPORTANCE_SAMPLING_LEVELS,
    IS_CORRECTIONS,
    KL_ESTIMATORS,
    LOSS_TYPES,
    MASK_MODES,
    SCALES,
    STDS,
    SURROGATES,
    UNSCALED_ESTIMATORS,
)
from grpo_cli.resources import CONF_DIR, RECIPES_DIR
from grpo_cli.rewards import models as reward_models
from grpo_cli.rollout import vllm_engine, vllm_server
from grpo_cli.user_code import import_targets


def register_recipes() -> None:
    """Store every recipes/*.yaml as `recipe/NAME` with package _global_, for `+recipe=NAME`."""
    store = ConfigStore.instance()
    for path in sorted(RECIPES_DIR.glob("*.yaml")):
        store.store(group="recipe", name=path.stem, node=OmegaConf.load(path), package="_global_")


def compose(config_name: str, overrides: list[str] | None = None) -> DictConfig:
    """The config Hydra would build for `grpo CONFIG_NAME OVERRIDES...`, without running a job."""
    register_recipes()
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base=None, config_dir=str(CONF_DIR)):
        return hydra_compose(config_name=config_name, overrides=list(overrides or []), return_hydra_config=False)


# ---- validation -------------------------------------------------------------------------------

# the optimizer section has no module of its own (torch builds it), so its checks live here
OPTIMIZER: list[Check] = [
    Rule("optimizer.lr", lambda v: is_num(v) and v > 0, "must be > 0; set optimizer.lr=1e-4"),
    Rule("optimizer.betas",
         lambda v: isinstance(v, ListConfig) and len(v) == 2 and all(is_num(b) and 0 <= b < 1 for b in v),
         "must be two numbers in [0, 1); set optimizer.betas=[0.9,0.99]"),
    Rule("optimizer.weight_decay", lambda v: is_num(v) and v >= 0, "must be >= 0; set optimizer.weight_decay=0.0"),
]

# the algo section's settings are the arguments of objective's pure functions, which take no config: its
# checks live here, with the names they allow from objective
ALGO: list[Check] = [
    Rule("algo.group_size", lambda v: is_int(v) and v >= 2,
         "must be an integer >= 2: GRPO normalizes rewards within a group; set algo.group_size=8"),
    Rule("algo.num_iterations", lambda v: is_int(v) and v >= 1, "must be an integer >= 1; set algo.num_iterations=1"),
    Rule("algo.beta", lambda v: is_num(v) and v >= 0, "must be >= 0 (0 turns the KL term off); set algo.beta=0.04"),
    Rule("algo.epsilon_low", lambda v: is_num(v) and 0 < v < 1, "must be in (0, 1); set algo.epsilon_low=0.2"),
    Rule("algo.epsilon_high", lambda v: v is None or (is_num(v) and v > 0),
         "must be > 0 or null (null: same as epsilon_low); set algo.epsilon_high=null"),
    Rule("algo.kl_estimator", lambda v: v in KL_ESTIMATORS,
         f"must be {one_of(KL_ESTIMATORS)}; set algo.kl_estimator=k3"),
    Rule("algo.loss_type", lambda v: v in LOSS_TYPES, f"must be {one_of(LOSS_TYPES)}; set algo.loss_type=grpo"),
    Rule("algo.advantage_scale", lambda v: v in SCALES, f"must be {one_of(SCALES)}; set algo.advantage_scale=group"),
    Rule("algo.advantage_std", lambda v: v in STDS, f"must be {one_of(STDS)}; set algo.advantage_std=population"),
    Rule("algo.advantage", lambda v: v in ESTIMATORS, f"must be {one_of(ESTIMATORS)}; set algo.advantage=grpo"),
    lambda cfg: _check_unscaled_advantage(cfg.get("algo")),
    lambda cfg: _check_advantage_of_step_rewards(cfg.get("algo"), cfg.get("reward")),
    lambda cfg: _check_credit_of_outcome_rewards(cfg.get("reward")),
    Rule("algo.is_correction_cap", lambda v: v is None or (is_num(v) and v >= 1),
         "must be >= 1 or null (off): the weight of a token both engines agree on is 1; set algo.is_correction_cap=2"),
    Rule("algo.importance_sampling_level", lambda v: v in IMPORTANCE_SAMPLING_LEVELS,
         f"must be {one_of(IMPORTANCE_SAMPLING_LEVELS)} (sequence: GSPO, or algo=gspo with its clip range); "
         f"set algo.importance_sampling_level=token"),
    Rule("algo.is_correction", lambda v: v in IS_CORRECTIONS,
         f"must be {one_of(IS_CORRECTIONS)}; set algo.is_correction=token_truncate"),
    Rule("algo.is_correction_min", lambda v: v is None or (is_num(v) and 0 < v <= 1),
         "must be in (0, 1] or null (null: 1/is_correction_cap); set algo.is_correction_min=null"),
    Rule("algo.entropy_coef", lambda v: is_num(v) and math.isfinite(v),
         "must be a number (0: off; verl uses ~1e-3); set algo.entropy_coef=0.0"),
    Rule("algo.top_entropy_quantile", lambda v: is_num(v) and 0 < v <= 1,
         "must be in (0, 1]: the share of highest-entropy tokens that carry the policy gradient (1.0: all; the "
         "paper keeps 0.2); set algo.top_entropy_quantile=1.0"),
    Rule("algo.cispo_cap", lambda v: is_num(v) and v >= 1,
         "must be >= 1: an on-policy token's weight is 1 (ScaleRL's ε_max; TRL suggests 5); set algo.cispo_cap=5"),
    Rule("algo.sapo_temperature_pos", lambda v: is_num(v) and v > 0,
         "must be > 0: the soft gate's temperature; set algo.sapo_temperature_pos=1.0"),
    Rule("algo.sapo_temperature_neg", lambda v: is_num(v) and v > 0,
         "must be > 0: the soft gate's temperature; set algo.sapo_temperature_neg=1.05"),
    lambda cfg: _check_is_correction(cfg.get("algo")),
    lambda cfg: _check_loss_variant(cfg.get("algo")),
]


def _check_unscaled_advantage(algo) -> list[str]:
    """RLOO's advantage divides by no std: divided by one it would be GRPO's times G/(G-1), a learning rate change."""
    if algo is None or algo.get("advantage") not in UNSCALED_ESTIMATORS or algo.get("advantage_scale") == "none":
        return []
    return [f"algo.advantage_scale ({algo.advantage_scale}) cannot be used with algo.advantage={algo.advantage}, "
            f"which divides by no std (divided by one it is GRPO's advantage times G/(G-1)): set "
            f"algo.advantage_scale=none, or use algo={algo.advantage}"]


# the rewards whose step rewards make process advantages, normalized as in the paper (update.advantages); with
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


# every library module that owns a config section, with its checks (grpo_cli.checks); a command adds its own
LIBRARY_CHECKS: list[Check] = [*ALGO, *policy.CHECKS, *rollout.CHECKS, *vllm_engine.CHECKS, *vllm_server.CHECKS,
                               *rewards.CHECKS, *reward_models.CHECKS, *iterative.CHECKS, *groups.CHECKS, *OPTIMIZER,
                               *env.CHECKS]


# sections of plain settings (no `_target_`): their keys are the ones their YAML file defines, so a
# typo such as `+trainer.max_step=100` is an error instead of a setting nobody reads
PLAIN_SECTIONS = {"trainer": "train.yaml", "iterative": "train.yaml", "algo": "algo/grpo.yaml", "eval": "eval.yaml",
                  "sample": "sample.yaml"}


def _unknown_keys(cfg: DictConfig) -> list[str]:
    errors = []
    for section, file in PLAIN_SECTIONS.items():
        if section not in cfg or not isinstance(cfg[section], DictConfig):
            continue
        known_node = OmegaConf.load(CONF_DIR / file)
        known = set((known_node[section] if section in known_node else known_node).keys())
        for key in cfg[section]:
            if key not in known:
                close = difflib.get_close_matches(str(key), sorted(known), n=1)
                hint = (f"did you mean {section}.{close[0]}?" if close
                        else f"`--cfg job` lists the {section} keys")
                errors.append(f"{section}.{key} is not a setting; {hint}")
    return errors




def _check_targets(node: Any, path: str, errors: list[str]) -> None:
    """Each `_target_` node's keys must be parameters of the callable it names; problems go to `errors`."""
    if isinstance(node, DictConfig):
        target = node.get("_target_") if "_target_" in node else None
        if target is not None:
            try:
                import_targets({"_target_": target}, path)  # the user's own module, from the working folder
                obj = get_object(target)
            except ConfigError as err:
                errors.append(str(err))
                return
            except Exception as err:  # ImportError, AttributeError, ...
                errors.append(f"{path}._target_ ({target}) cannot be imported: {err}; check the module path")
                return
            keys = [k for k in node.keys() if not str(k).startswith("_")]
            try:
                params = inspect.signature(obj).parameters
            except (TypeError, ValueError):
                params = {}
            takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
            if params and not takes_any:
                allowed = ", ".join(p for p in params if p not in ("self", "args", "kwargs"))
                errors.extend(f"{path}.{key} is not a parameter of {target}; remove it or use one of: {allowed}"
                              for key in keys if key not in params)
            # a function whose required arguments come at call time (a reward function's prompts and
            # completions) must be built as a partial, or building it calls it without them
            required = [name for name, p in params.items() if p.default is inspect.Parameter.empty
                        and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and name not in keys]
            if inspect.isfunction(obj) and required and not node.get("_partial_", False):
                errors.append(f"{path} ({target}) needs {', '.join(required)} when it is called; "
                              f"add `_partial_: true` to {path}")
        for k in node:
            if not OmegaConf.is_missing(node, k):  # a ??? value is reported once, by validate, naming its key
                _check_targets(node[k], f"{path}.{k}", errors)
    elif isinstance(node, ListConfig):
        for i, item in enumerate(node):
            _check_targets(item, f"{path}[{i}]", errors)


def validate(cfg: DictConfig, *command_checks: Check) -> DictConfig:
    """Run every section's checks (the library modules' and the command's own) and check every `_target_`
    node; raise one ConfigError listing all problems (one line each: field, value, fix), or return cfg."""
    try:
        OmegaConf.resolve(cfg)
    except Exception as err:
        raise ConfigError(f"the config does not resolve: {err}") from None
    errors = [line for check in (*LIBRARY_CHECKS, *command_checks) for line in check(cfg)]
    errors.extend(f"{key} is required and has no value; set it on the command line: {key}=..."
                  for key in sorted(OmegaConf.missing_keys(cfg)))
    errors.extend(_unknown_keys(cfg))
    for section in cfg:
        if section != "hydra" and not OmegaConf.is_missing(cfg, section):
            _check_targets(cfg[section], str(section), errors)
    if errors:
        raise ConfigError("\n".join(errors))
    return cfg


# ---- configs saved in checkpoints ------------------------------------------------------------





