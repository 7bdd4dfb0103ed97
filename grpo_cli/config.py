"""The composed config: where the YAML lives, recipe registration, and validation before heavy work.

Every setting has one home, its line in a YAML file under `conf/`; this module holds no defaults.
`validate(cfg)` checks the values a typo or a bad sweep could break, and checks each `_target_`
node's keys against the signature of what it builds (as torchtune does), so a wrong key fails in
milliseconds with a message that names the field and the fix, not after a 20 s model load.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import get_object
from omegaconf import DictConfig, ListConfig, OmegaConf

from grpo_cli import algo, env, iterative, policy, rewards, rollout
from grpo_cli.checks import Check, Rule, is_num
from grpo_cli.errors import ConfigError
from grpo_cli.resources import CONF_DIR, RECIPES_DIR
from grpo_cli.rewards import models as reward_models
from grpo_cli.rollout import vllm_engine, vllm_server
from grpo_cli.user_code import import_targets

# the recipe files (name, text) that this process's ConfigStore holds, as register_recipes stored them
_registered: tuple = ()


def register_recipes() -> None:
    """Store every recipes/*.yaml as `recipe/NAME` with package _global_, for `+recipe=NAME`.

    Once a process, and again only when a recipe file has changed: a command registers at import (hydra_app) and
    before each compose (its early check of the overrides), and each registration parsed and stored all the files
    anew. The ConfigStore is a process-wide singleton that keeps what was stored in it. The texts are read each
    time (microseconds; a size and mtime could miss an edit within the clock's tick), the parse and store kept."""
    global _registered
    paths = sorted(RECIPES_DIR.glob("*.yaml"))
    files = tuple((p.name, p.read_text(encoding="utf-8")) for p in paths)
    store = ConfigStore.instance()
    stored = store.repo.get("recipe", {})
    if files == _registered and all(f"{p.stem}.yaml" in stored for p in paths):
        return
    for path in paths:
        store.store(group="recipe", name=path.stem, node=OmegaConf.load(path), package="_global_")
    _registered = files


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

# every library module that owns a config section, with its checks (grpo_cli.checks); a command adds its own
LIBRARY_CHECKS: list[Check] = [*algo.CHECKS, *policy.CHECKS, *rollout.CHECKS, *vllm_engine.CHECKS, *vllm_server.CHECKS,
                               *rewards.CHECKS, *reward_models.CHECKS, *iterative.CHECKS, *OPTIMIZER, *env.CHECKS]


# sections of plain settings (no `_target_`): their keys are the ones their YAML file defines, so a
# typo such as `+trainer.max_step=100` is an error instead of a setting nobody reads
PLAIN_SECTIONS = {"trainer": "train.yaml", "iterative": "train.yaml", "algo": "algo/grpo.yaml", "eval": "eval.yaml",
                  "sample": "sample.yaml"}


# {(file, its text): {a section: its keys}} of the PLAIN_SECTIONS files: each text parsed once a process
_FILE_KEYS: dict[tuple[str, str], dict[str, frozenset]] = {}


def _known_keys(file: str, section: str) -> frozenset:
    """The keys conf/FILE defines for `section` (its top-level keys where FILE has no such section). Each validate
    parsed each section's file, train.yaml twice (it holds trainer and iterative); the text is read each time (an
    edited file is parsed anew), the parse kept."""
    text = (CONF_DIR / file).read_text(encoding="utf-8")
    cached = _FILE_KEYS.setdefault((file, text), {})
    if section not in cached:
        plain = OmegaConf.to_container(OmegaConf.create(text), resolve=False)  # ??? and ${..} values as they are
        cached.update({str(k): frozenset(v) for k, v in plain.items() if isinstance(v, dict)})
        cached.setdefault(section, frozenset(plain))
    return cached[section]


def _unknown_keys(cfg: DictConfig) -> list[str]:
    errors = []
    for section, file in PLAIN_SECTIONS.items():
        if section not in cfg or not isinstance(cfg[section], DictConfig):
            continue
        known = _known_keys(file, section)
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





