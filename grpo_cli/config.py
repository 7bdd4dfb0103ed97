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
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from grpo_cli.errors import ConfigError, RunError
from grpo_cli.objective import KL_ESTIMATORS, LOSS_TYPES, SCALES, STDS
from grpo_cli.policy import ATTN_IMPLEMENTATIONS, DTYPES

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
    """Decorator: a Hydra main over conf/CONFIG_NAME.yaml whose errors end in one line each, no traceback.

    ConfigError (a setting, an input file): exit 2. RunError and OSError (disk full, a read-only
    folder): exit 1. Ctrl-C outside the training loop's own handler (during a model load): exit 130.
    """
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
            except (RunError, OSError) as err:
                if os.environ.get("HYDRA_FULL_ERROR") == "1":
                    raise
                print(f"error: {err}", file=sys.stderr)
                sys.exit(1)
            except KeyboardInterrupt:
                print("interrupted", file=sys.stderr)
                sys.exit(130)
            except Exception as err:
                # a Ctrl-C inside a lazy import comes back as transformers' ModuleNotFoundError
                if _caused_by_interrupt(err) and os.environ.get("HYDRA_FULL_ERROR") != "1":
                    print("interrupted", file=sys.stderr)
                    sys.exit(130)
                raise

        app = hydra.main(version_base=None, config_path=str(CONF_DIR), config_name=config_name)(task)

        @functools.wraps(fn)
        def entry() -> Any:
            _precompose(config_name, sys.argv[1:])
            sys.argv += rank_overrides(config_name, sys.argv[1:])
            _check_output_dir(sys.argv[1:])
            return app()

        return entry

    return wrap


def rank_overrides(config_name: str, argv: list[str]) -> list[str]:
    """Overrides that make N ranks (torchrun) one run: every rank's run folder is the one rank 0's clock
    names (Hydra's ${now:} is read on each rank), and only rank 0 writes Hydra's .hydra/ and log file."""
    from grpo_cli.distributed import init_world, start_time, world_size

    if world_size() == 1:
        return []
    world = init_world()
    extra = []
    if not any(arg.startswith("hydra.run.dir=") for arg in argv):
        hydra_node = OmegaConf.load(CONF_DIR / f"{config_name}.yaml").hydra
        pattern = OmegaConf.to_container(hydra_node.run, resolve=False)["dir"]
        when = start_time()
        extra.append("hydra.run.dir=" + re.sub(r"\$\{now:([^}]*)\}", lambda m: when.strftime(m.group(1)), pattern))
    if not world.main:
        extra += ["hydra.output_subdir=null", "hydra/job_logging=disabled"]
    return extra


def _check_output_dir(argv: list[str]) -> None:
    """Hydra creates the run folder before any of our code runs; a folder it cannot create (a
    read-only file system, no permission) would end in its traceback, so check first."""
    sweep = any(a in ("-m", "--multirun") for a in argv)
    key = "hydra.sweep.dir=" if sweep else "hydra.run.dir="
    given = [a.split("=", 1)[1] for a in argv if a.startswith(key)]
    folder = Path(given[-1] if given else ("multirun" if sweep else "outputs")).absolute()
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not os.access(existing, os.W_OK):
        print(f"error: cannot write the run folder {folder} ({existing} is read-only or not writable); "
              f"choose another: {key}...", file=sys.stderr)
        sys.exit(2)


def _caused_by_interrupt(err: BaseException) -> bool:
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, KeyboardInterrupt):
            return True
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return False


def _precompose(config_name: str, argv: list[str]) -> None:
    """Compose the command line's overrides once before Hydra does, so that an override Hydra cannot
    apply (`trainer.foo=1`, `+recipe=nope`) ends in one `error:` line, exit 2, not Hydra's report.

    Skipped for sweeps (-m) and Hydra's own flags (--help, --cfg, ...), which Hydra handles itself.
    """
    if any(a.startswith("-") for a in argv) or os.environ.get("HYDRA_FULL_ERROR") == "1":
        return
    try:
        compose(config_name, [a for a in argv if not a.startswith("hydra.")])
    except Exception as err:  # Hydra's ConfigCompositionException, OverrideParseException, ...
        text = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
        text = text.split(" Config search path:")[0]
        unknown = re.match(r"Could not override '([^']+)'", text)
        if unknown:
            import difflib

            key = unknown.group(1)
            keys = _flat_keys(compose(config_name))
            close = difflib.get_close_matches(key, keys, n=1)
            text = f"{key} is not a setting; " + (f"did you mean {close[0]}?" if close
                                                     else "`--cfg job` lists the settings")
        print(f"error: {text[:400]}", file=sys.stderr)
        sys.exit(2)


def _flat_keys(node: Any, prefix: str = "") -> list[str]:
    """Dotted paths of every leaf of a config node."""
    if isinstance(node, DictConfig):
        return [k for key in node for k in _flat_keys(node._get_node(key), f"{prefix}{key}.")]
    return [prefix[:-1]]


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


def _schedulers() -> list[str]:
    from transformers.trainer_utils import SchedulerType

    return [s.value for s in SchedulerType]


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _flash_attn() -> bool:
    import importlib.util

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
    import difflib

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
    from grpo_cli.rollout import vllm as engine

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
    an error: a LoRA adapter only fits the weights it was trained on. The reward of an iterative run
    is not inherited: its reward model was retrained at every iteration (RUN/rm/iteration_NNN), so
    the command's own reward (a rule reward by default) scores the completions.
    """
    cfg = cfg.copy()
    iterative = bool(OmegaConf.select(saved, "iterative.iterations", default=0))
    for section in INHERITED:
        if section not in saved or (section == "reward" and iterative):
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
