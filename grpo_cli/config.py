"""The composed config: where the YAML lives, recipe registration, and validation before heavy work.

Every setting has one home, its line in a YAML file under `conf/`; this module holds no defaults.
`validate(cfg)` checks the values a typo or a bad sweep could break, and checks each `_target_`
node's keys against the signature of what it builds (as torchtune does), so a wrong key fails in
milliseconds with a message that names the field and the fix, not after a 20 s model load.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from grpo_cli.errors import ConfigError
from grpo_cli.objective import KL_ESTIMATORS, LOSS_TYPES, SCALES, STDS
from grpo_cli.policy import DTYPES

_PKG = Path(__file__).resolve().parent


def _resource_dir(name: str) -> Path:
    """conf/ and recipes/ sit beside the package in the source tree and inside it in a wheel."""
    for candidate in (_PKG / name, _PKG.parent / name):
        if candidate.is_dir():
            return candidate
    raise RuntimeError(f"cannot find the {name}/ folder next to {_PKG}; reinstall grpo-cli")


CONF_DIR = _resource_dir("conf")
RECIPES_DIR = _resource_dir("recipes")


def register_recipes() -> None:
    """Store every recipes/*.yaml as `recipe/NAME` with package _global_, for `+recipe=NAME`."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for path in sorted(RECIPES_DIR.glob("*.yaml")):
        store.store(group="recipe", name=path.stem, node=OmegaConf.load(path), package="_global_")


def hydra_app(config_name: str) -> Callable:
    """Decorator: a Hydra main over conf/CONFIG_NAME.yaml whose ConfigErrors end in one line, exit 2."""
    import hydra

    register_recipes()

    def wrap(fn: Callable[[DictConfig], Any]) -> Callable:
        @functools.wraps(fn)
        def task(cfg: DictConfig) -> Any:
            try:
                return fn(cfg)
            except ConfigError as err:
                if os.environ.get("HYDRA_FULL_ERROR") == "1":
                    raise
                for line in str(err).splitlines():  # validate() reports every problem, one per line
                    print(f"error: {line}", file=sys.stderr)
                sys.exit(2)

        return hydra.main(version_base=None, config_path=str(CONF_DIR), config_name=config_name)(task)

    return wrap


def build(node: Any, **kwargs: Any) -> Any:
    """`hydra.utils.instantiate(node)` with plain containers, re-raising our ConfigError unwrapped.

    Hydra wraps anything a constructor raises in InstantiationException; a bad `data.path` must
    still reach the user as our one-line error, not a traceback.
    """
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        return instantiate(node, _convert_="all", **kwargs)
    except InstantiationException as err:
        cause = err.__cause__
        while cause is not None and not isinstance(cause, ConfigError):
            cause = cause.__cause__
        if cause is not None:
            raise cause from None
        raise


def compose(config_name: str, overrides: list[str] | None = None) -> DictConfig:
    """The config Hydra would build for `grpo CONFIG_NAME OVERRIDES...`, without running a job."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_recipes()
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base=None, config_dir=str(CONF_DIR)):
        return hydra_compose(config_name=config_name, overrides=list(overrides or []), return_hydra_config=False)


# ---- validation -------------------------------------------------------------------------------

def _one_of(values) -> str:
    values = list(values)
    return ", ".join(values[:-1]) + " or " + values[-1]


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# (dotted key, check, what is wrong and the fix). A key absent from the config is skipped, so
# one rule table serves train, eval and sample.
RULES: list[tuple[str, Callable[[Any], bool], str]] = [
    ("algo.group_size", lambda v: _int(v) and v >= 2,
     "must be an integer >= 2: GRPO normalizes rewards within a group; set algo.group_size=8"),
    ("algo.num_iterations", lambda v: _int(v) and v >= 1, "must be an integer >= 1; set algo.num_iterations=1"),
    ("algo.beta", lambda v: _num(v) and v >= 0, "must be >= 0 (0 turns the KL term off); set algo.beta=0.04"),
    ("algo.epsilon_low", lambda v: _num(v) and 0 < v < 1, "must be in (0, 1); set algo.epsilon_low=0.2"),
    ("algo.epsilon_high", lambda v: v is None or (_num(v) and v > 0),
     "must be > 0 or null (null: same as epsilon_low); set algo.epsilon_high=null"),
    ("algo.kl_estimator", lambda v: v in KL_ESTIMATORS, f"must be {_one_of(KL_ESTIMATORS)}; set algo.kl_estimator=k3"),
    ("algo.loss_type", lambda v: v in LOSS_TYPES, f"must be {_one_of(LOSS_TYPES)}; set algo.loss_type=grpo"),
    ("algo.advantage_scale", lambda v: v in SCALES, f"must be {_one_of(SCALES)}; set algo.advantage_scale=group"),
    ("algo.advantage_std", lambda v: v in STDS, f"must be {_one_of(STDS)}; set algo.advantage_std=population"),
    ("sampler.temperature", lambda v: _num(v) and v > 0,
     "must be > 0 (for greedy decoding use a small value such as 1e-5 or eval's greedy pass); "
     "set sampler.temperature=1.0"),
    ("sampler.top_p", lambda v: _num(v) and 0 < v <= 1, "must be in (0, 1]; set sampler.top_p=1.0"),
    ("sampler.top_k", lambda v: _int(v) and v >= 0, "must be an integer >= 0 (0: off); set sampler.top_k=0"),
    ("sampler.max_new_tokens", lambda v: _int(v) and v >= 1,
     "must be an integer >= 1; set sampler.max_new_tokens=64"),
    ("optimizer.lr", lambda v: _num(v) and v > 0, "must be > 0; set optimizer.lr=1e-4"),
    ("trainer.max_steps", lambda v: _int(v) and v >= 1, "must be an integer >= 1; set trainer.max_steps=10"),
    ("trainer.prompts_per_step", lambda v: _int(v) and v >= 1,
     "must be an integer >= 1; set trainer.prompts_per_step=4"),
    ("trainer.micro_batch_size", lambda v: _int(v) and v >= 1,
     "must be an integer >= 1; set trainer.micro_batch_size=8"),
    ("trainer.save_every", lambda v: _int(v) and v >= 1, "must be an integer >= 1; set trainer.save_every=20"),
    ("trainer.keep_last", lambda v: v is None or (_int(v) and v >= 1),
     "must be an integer >= 1 or null (keep all); set trainer.keep_last=3"),
    ("trainer.max_grad_norm", lambda v: v is None or (_num(v) and v > 0),
     "must be > 0 or null (no clipping); set trainer.max_grad_norm=1.0"),
    ("model.lora.r", lambda v: _int(v) and v >= 1, "must be an integer >= 1; set model.lora.r=16"),
    ("model.device", lambda v: isinstance(v, str) and (v in ("auto", "cpu") or v.startswith("cuda")),
     "must be auto, cpu or cuda[:N]; set model.device=auto"),
    ("model.dtype", lambda v: v == "auto" or v in DTYPES, f"must be auto or {_one_of(DTYPES)}; set model.dtype=auto"),
]


def _get(cfg: DictConfig, key: str) -> tuple[bool, Any]:
    node: Any = cfg
    for part in key.split("."):
        if not isinstance(node, DictConfig) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _check_targets(node: Any, path: str, errors: list[str]) -> None:
    """Each `_target_` node's keys must be parameters of the callable it names; problems go to `errors`."""
    if isinstance(node, DictConfig):
        target = node.get("_target_") if "_target_" in node else None
        if target is not None:
            from hydra.utils import get_object

            try:
                obj = get_object(target)
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
        for k, child in node.items():
            _check_targets(child, f"{path}.{k}", errors)
    elif isinstance(node, ListConfig):
        for i, item in enumerate(node):
            _check_targets(item, f"{path}[{i}]", errors)


def validate(cfg: DictConfig) -> DictConfig:
    """Check every rule and every `_target_` node; raise one ConfigError listing all problems
    (one line each: field, value, fix), or return cfg."""
    try:
        OmegaConf.resolve(cfg)
    except Exception as err:
        raise ConfigError(f"the config does not resolve: {err}") from None
    errors = []
    for key, ok, fix in RULES:
        present, value = _get(cfg, key)
        if present and not ok(value):
            errors.append(f"{key} ({value!r}) {fix}")
    errors.extend(f"{key} is required and has no value; set it on the command line: {key}=..."
                  for key in sorted(OmegaConf.missing_keys(cfg)))
    for section, node in cfg.items():
        if section != "hydra":
            _check_targets(node, str(section), errors)
    if errors:
        raise ConfigError("\n".join(errors))
    return cfg


# ---- configs saved in checkpoints ------------------------------------------------------------

# what a checkpoint's config.yaml supplies to eval and sample unless the command line says otherwise
INHERITED = ("model", "data", "reward", "sampler")


def command_line_overrides() -> list[str]:
    """The task overrides of the running Hydra job ([] outside one)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def inherit(cfg: DictConfig, saved: DictConfig, overrides: list[str]) -> DictConfig:
    """`cfg` with the model/data/reward/sampler sections of a checkpoint's `saved` config.

    A group override on the command line (`data=gsm8k`) keeps the composed section; dotted
    overrides (`data.limit=50`) are applied on top of the saved section. A different base model is
    an error: a LoRA adapter only fits the weights it was trained on.
    """
    cfg = cfg.copy()
    for section in INHERITED:
        if section not in saved:
            continue
        group_override = any(o.lstrip("+~").split("=")[0] == section for o in overrides)
        if section == "model" and group_override and cfg.model.get("name") != saved.model.get("name"):
            raise ConfigError(f"model {cfg.model.get('name')!r} was requested but the checkpoint was trained on "
                              f"{saved.model.get('name')!r}; drop the model= override")
        if group_override:
            continue
        merged = saved[section].copy()
        dotted = [o.lstrip("+") for o in overrides if o.lstrip("+").startswith(section + ".")]
        if dotted:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(dotted)[section])
        cfg[section] = merged
    return cfg
