"""The composed config: where the YAML lives, recipe registration, and validation before heavy work.

Every setting has one home, its line in a YAML file under `conf/`; this module holds no defaults.
`validate(cfg)` checks the values a typo or a bad sweep could break, and checks each `_target_`
node's keys against the signature of what it builds (as torchtune does), so a wrong key fails in
milliseconds with a message that names the field and the fix, not after a 20 s model load.
"""

from __future__ import annotations

import difflib
import importlib.util
import inspect
import os
from collections.abc import Callable
from typing import Any

import torch
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import get_object
from omegaconf import DictConfig, ListConfig, OmegaConf
from transformers.trainer_utils import SchedulerType

from grpo_cli.errors import ConfigError
from grpo_cli.objective import KL_ESTIMATORS, LOSS_TYPES, SCALES, STDS
from grpo_cli.policy import ATTN_IMPLEMENTATIONS, DTYPES
from grpo_cli.resources import CONF_DIR, RECIPES_DIR
from grpo_cli.rollout import vllm as engine


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

def _one_of(values) -> str:
    values = list(values)
    return ", ".join(values[:-1]) + " or " + values[-1]


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _schedulers() -> list[str]:
    return [s.value for s in SchedulerType]


def _cuda() -> bool:
    return torch.cuda.is_available()


def _flash_attn() -> bool:
    return _cuda() and importlib.util.find_spec("flash_attn") is not None


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
    ("optimizer.betas",
     lambda v: isinstance(v, ListConfig) and len(v) == 2 and all(_num(b) and 0 <= b < 1 for b in v),
     "must be two numbers in [0, 1); set optimizer.betas=[0.9,0.99]"),
    ("optimizer.weight_decay", lambda v: _num(v) and v >= 0, "must be >= 0; set optimizer.weight_decay=0.0"),
    ("trainer.seed", lambda v: _int(v) and v >= 0, "must be an integer >= 0; set trainer.seed=0"),
    ("trainer.lr_scheduler", lambda v: v in _schedulers(),
     "must be a transformers scheduler name (constant, constant_with_warmup, linear, cosine, ...); "
     "set trainer.lr_scheduler=constant_with_warmup"),
    ("trainer.warmup_steps", lambda v: _int(v) and v >= 0, "must be an integer >= 0; set trainer.warmup_steps=0"),
    ("trainer.gradient_checkpointing", lambda v: isinstance(v, bool),
     "must be true or false; set trainer.gradient_checkpointing=false"),
    ("trainer.max_nonfinite_steps", lambda v: _int(v) and v >= 1,
     "must be an integer >= 1; set trainer.max_nonfinite_steps=3"),
    ("reward.timeout_s", lambda v: v is None or (_num(v) and v > 0),
     "must be > 0 seconds or null (wait forever); set reward.timeout_s=10"),
    ("sampler.batch_size", lambda v: v is None or (_int(v) and v >= 1),
     "must be an integer >= 1 or null (one call per step); set sampler.batch_size=null"),
    ("sampler.max_prompt_tokens", lambda v: _int(v) and v >= 1,
     "must be an integer >= 1; set sampler.max_prompt_tokens=1024"),
    # sampler=vllm's engine settings
    ("sampler.dtype", lambda v: v == "auto" or v in DTYPES,
     f"must be auto or {_one_of(DTYPES)}; set sampler.dtype=auto"),
    ("sampler.enforce_eager", lambda v: isinstance(v, bool), "must be true or false; set sampler.enforce_eager=true"),
    ("sampler.enforce_eager", lambda v: v is not False or _cuda(),
     "must be true on a machine without a GPU: a compiled CPU graph would not see the weights each step pushes; "
     "set sampler.enforce_eager=true"),
    ("sampler.max_model_len", lambda v: v is None or (_int(v) and v >= 1),
     "must be an integer >= 1 or null (the model's context); set sampler.max_model_len=null"),
    ("sampler.cpu_kv_cache_gb", lambda v: _num(v) and v > 0, "must be > 0 (GiB); set sampler.cpu_kv_cache_gb=1.0"),
    ("sampler.gpu_memory_utilization", lambda v: _num(v) and 0 < v <= 1,
     "must be in (0, 1]; set sampler.gpu_memory_utilization=0.3"),
    ("sampler.enable_sleep_mode", lambda v: isinstance(v, bool),
     "must be true or false; set sampler.enable_sleep_mode=false"),
    ("algo.is_correction_cap", lambda v: v is None or (_num(v) and v >= 1),
     "must be >= 1 or null (off): the weight of a token both engines agree on is 1; set algo.is_correction_cap=2"),
    ("eval.limit", lambda v: v is None or (_int(v) and v >= 1),
     "must be an integer >= 1 or null (all); set eval.limit=200"),
    ("eval.batch_size", lambda v: _int(v) and v >= 1, "must be an integer >= 1; set eval.batch_size=32"),
    ("eval.num_samples", lambda v: _int(v) and v >= 0,
     "must be an integer >= 0 (0: greedy only); set eval.num_samples=0"),
    ("eval.k", lambda v: isinstance(v, ListConfig) and len(v) > 0 and all(_int(k) and k >= 1 for k in v),
     "must be a list of integers >= 1; set eval.k=[1,4]"),
    ("eval.temperature", lambda v: _num(v) and v > 0, "must be > 0; set eval.temperature=1.0"),
    ("eval.max_new_tokens", lambda v: v is None or (_int(v) and v >= 1),
     "must be an integer >= 1 or null (sampler.max_new_tokens); set eval.max_new_tokens=null"),
    ("eval.seed", lambda v: _int(v) and v >= 0, "must be an integer >= 0; set eval.seed=0"),
    ("eval.include_base", lambda v: isinstance(v, bool), "must be true or false; set eval.include_base=false"),
    ("sample.seed", lambda v: _int(v) and v >= 0, "must be an integer >= 0; set sample.seed=0"),
    ("sample.n", lambda v: _int(v) and v >= 1, "must be an integer >= 1; set sample.n=4"),
    ("sample.num_prompts", lambda v: _int(v) and v >= 1, "must be an integer >= 1; set sample.num_prompts=2"),
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
    ("iterative.iterations", lambda v: _int(v) and v >= 0,
     "must be an integer >= 0 (0: off); set iterative.iterations=0"),
    ("iterative.steps", lambda v: _int(v) and v >= 1, "must be an integer >= 1; set iterative.steps=10"),
    ("iterative.temperature", lambda v: v is None or (_num(v) and v > 0),
     "must be > 0 or null (sampler.temperature); set iterative.temperature=null"),
    ("model.lora.r", lambda v: _int(v) and v >= 1, "must be an integer >= 1; set model.lora.r=16"),
    ("model.lora.alpha", lambda v: _num(v) and v > 0, "must be a number > 0 (often 2 x r); set model.lora.alpha=32"),
    ("model.lora.dropout", lambda v: _num(v) and 0 <= v < 1, "must be in [0, 1); set model.lora.dropout=0.0"),
    ("model.lora.target_modules", lambda v: isinstance(v, ListConfig) and len(v) > 0
     and all(isinstance(m, str) and m for m in v),
     "must be a non-empty list of module names; set model.lora.target_modules=[q_proj,v_proj]"),
    ("model.device", lambda v: isinstance(v, str) and (v in ("auto", "cpu") or v.startswith("cuda")),
     "must be auto, cpu or cuda[:N]; set model.device=auto"),
    ("model.device", lambda v: not (isinstance(v, str) and v.startswith("cuda")) or _cuda(),
     "asks for CUDA but torch sees no GPU here; set model.device=auto (CPU when there is no GPU)"),
    ("model.dtype", lambda v: v == "auto" or v in DTYPES, f"must be auto or {_one_of(DTYPES)}; set model.dtype=auto"),
    ("model.attn_implementation", lambda v: v is None or v in ATTN_IMPLEMENTATIONS,
     f"must be one of {', '.join(ATTN_IMPLEMENTATIONS)}, or null (transformers' choice); "
     f"set model.attn_implementation=sdpa"),
    ("model.attn_implementation", lambda v: v != "flash_attention_2" or _flash_attn(),
     "needs a CUDA GPU and the flash-attn package (pip install flash-attn --no-build-isolation); "
     "set model.attn_implementation=sdpa"),
]

# model.dtype values that can run a model but not train it: fp16 gradients underflow without a loss scaler
_NO_TRAINING = ("float16", "fp16")


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


def _sampler_engine(cfg: DictConfig) -> list[str]:
    """sampler=vllm needs vLLM (the install command, before any model loads); the importance-sampling
    cap needs a sampler that returns its own log-probs."""
    target = str(_get(cfg, "sampler._target_")[1])
    uses_vllm = target.startswith(engine.__name__ + ".")
    errors = []
    if uses_vllm and not engine.installed():
        errors.append(f"sampler=vllm needs vLLM, which is not installed: {engine.INSTALL}; or use sampler=default")
    if uses_vllm and int(os.environ.get("WORLD_SIZE", "1")) > 1:  # its in-process engine sets up torch.distributed
        errors.append("sampler=vllm runs one engine in one process for now, not one per torchrun rank; launch "
                      "without torchrun, or use sampler=default")
    cap = _get(cfg, "algo.is_correction_cap")[1]
    if cap is not None and target.startswith("grpo_cli.rollout.hf."):
        errors.append(f"algo.is_correction_cap ({cap!r}) corrects for a sampler with its own copy of the weights, "
                      f"but HF generate samples from the policy itself; set algo.is_correction_cap=null or "
                      f"sampler=vllm")
    return errors


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
            # a function whose required arguments come at call time (a reward function's prompts and
            # completions) must be built as a partial, or building it calls it without them
            required = [name for name, p in params.items() if p.default is inspect.Parameter.empty
                        and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and name not in keys]
            if inspect.isfunction(obj) and required and not node.get("_partial_", False):
                errors.append(f"{path} ({target}) needs {', '.join(required)} when it is called; "
                              f"add `_partial_: true` to {path}")
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
    trains = "trainer" in cfg or "rm" in cfg  # grpo train, grpo rm (eval, sample and export only run the model)
    if trains and _get(cfg, "model.dtype")[1] in _NO_TRAINING:
        errors.append(f"model.dtype ({cfg.model.dtype!r}) cannot train: fp16 gradients underflow without a loss "
                      f"scaler, which this trainer does not have; set model.dtype=bfloat16 (GPUs from Ampere on) "
                      f"or model.dtype=float32")
    errors.extend(_unknown_keys(cfg))
    errors.extend(_sampler_engine(cfg))
    for section in cfg:
        if section != "hydra" and not OmegaConf.is_missing(cfg, section):
            _check_targets(cfg[section], str(section), errors)
    if errors:
        raise ConfigError("\n".join(errors))
    return cfg


# ---- configs saved in checkpoints ------------------------------------------------------------





