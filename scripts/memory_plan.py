"""Which settings fit which model on which GPUs: the memory arithmetic behind docs/multi-device.md's table.

    .venv/bin/python scripts/memory_plan.py                   # the table (markdown), GSM8K-shaped job
    .venv/bin/python scripts/memory_plan.py --gpu-gb 40 --prompts-per-rank 4 --group-size 16

Per rank, in GB (10^9 bytes), for LoRA r16 on the 7 projections, bf16 compute, AdamW:
  - base weights: 2 bytes a parameter (bf16); NF4 (model.quantization=4bit, double quant): 0.5 byte plus
    ~0.016 byte of block constants (a 64-value block's 8-bit absmax, itself quantized in blocks of 256);
    trainer.fsdp=true shards the bf16 base over the N ranks (1/N each), one layer whole at a time
    (with HF generate: FSDP with sampler=vllm is refused today);
  - adapter: 16 bytes an adapter parameter (fp32 weight, gradient, AdamW's two moments), on every rank;
  - activations of one 8-row bucket (what the update holds at once, logprobs.py): 8 rows x (prompt + completion)
    tokens x layers x 34 x hidden bytes (Korthikanti et al. 2022's 16-bit transformer-layer figure with fused
    attention: no seq^2 term), x (intermediate / 4 hidden) for the MLP's share; with gradient checkpointing
    2 x hidden bytes a token a layer plus one layer's full set. The LM head is fused in chunks: no logits;
  - vLLM colocated (sampler=vllm): its own bf16 copy of the merged weights (1/TP each) and the KV cache of the
    rank's rollout: prompts x G x (prompt + new) tokens x 2 (K, V) x layers x KV heads x head_dim x 2 bytes;
  - 1.5 GB of CUDA context, allocator slack and the framework.
A setting fits when the sum is below the GPU's memory; the table names the first that fits, in the order of
`options`. It is arithmetic, not a measurement: no GPU has run these (docs/multi-device.md says what has).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from grpo_cli.rollout.sizing import kv_bytes_per_token

GB = 1e9
LORA_TARGETS = 7  # q, k, v, o, gate, up, down


@dataclass(frozen=True)
class Arch:
    """The dimensions the arithmetic needs (a HF config's names)."""

    name: str
    params: float  # all parameters, embeddings included
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int


# the Qwen2.5 instruct family (their config.json); 135M: the embedded SmolLM2
MODELS = [
    Arch("SmolLM2-135M", 0.135e9, 576, 30, 9, 3, 64, 1536),
    Arch("Qwen2.5-0.5B", 0.49e9, 896, 24, 14, 2, 64, 4864),
    Arch("Qwen2.5-1.5B", 1.54e9, 1536, 28, 12, 2, 128, 8960),
    Arch("Qwen2.5-7B", 7.6e9, 3584, 28, 28, 4, 128, 18944),
    Arch("Qwen2.5-14B", 14.7e9, 5120, 48, 40, 8, 128, 13824),
    Arch("Qwen2.5-32B", 32.5e9, 5120, 64, 40, 8, 128, 27648),
    Arch("Qwen2.5-72B", 72.7e9, 8192, 80, 64, 8, 128, 29568),
]


@dataclass(frozen=True)
class Job:
    prompts_per_rank: int = 8
    group_size: int = 8
    prompt_tokens: int = 200
    new_tokens: int = 256
    lora_r: int = 16
    bucket_rows: int = 8


def adapter_params(m: Arch, r: int) -> int:
    """LoRA parameters on the 7 projections: r x (in + out) each, per layer."""
    q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    d, i = m.hidden_size, m.intermediate_size
    per_layer = (d + q) + 2 * (d + kv) + (q + d) + 2 * (d + i) + (i + d)
    return r * per_layer * m.num_hidden_layers


def activations_gb(m: Arch, job: Job, checkpointing: bool) -> float:
    """One bucket's saved activations for the backward, bf16."""
    tokens = job.bucket_rows * (job.prompt_tokens + job.new_tokens)
    per_layer = 34 * m.hidden_size * max(1.0, m.intermediate_size / (4 * m.hidden_size))  # bytes a token
    if checkpointing:  # each layer's input kept, one layer's full set recomputed at a time
        return tokens * (2 * m.hidden_size * m.num_hidden_layers + per_layer) / GB
    return tokens * per_layer * m.num_hidden_layers / GB


def kv_cache_gb(m: Arch, job: Job) -> float:
    """vLLM's KV cache for the rank's rollout, bf16."""
    tokens = job.prompts_per_rank * job.group_size * (job.prompt_tokens + job.new_tokens)
    return tokens * kv_bytes_per_token(m, 2) / GB  # the rule the engine's own sizing uses (rollout/sizing.py)


def per_rank_gb(m: Arch, job: Job, *, quant4: bool = False, fsdp_ranks: int = 1, checkpointing: bool = False,
                sampler: str = "vllm", tp: int = 1) -> dict[str, float]:
    """The memory one rank needs at its peak, by part. `sampler`: vllm (awake through the update), vllm_sleep
    (sampler.enable_sleep_mode: weights to host memory and KV cache freed during the update, so the peak is the
    larger of the rollout's and the update's), hf (HF generate on the policy: its KV cache during the rollout)."""
    base = m.params * (0.516 if quant4 else 2.0) / fsdp_ranks
    if fsdp_ranks > 1:  # one layer gathered whole while it runs
        base += 2.0 * m.params / m.num_hidden_layers
    parts = {"base": base / GB, "adapter": 16 * adapter_params(m, job.lora_r) / GB,
             "activations": activations_gb(m, job, checkpointing), "overhead": 1.5}
    engine = 2.0 * m.params / tp / GB + kv_cache_gb(m, job) if sampler.startswith("vllm") else kv_cache_gb(m, job)
    parts["rollout"] = engine
    # awake vLLM holds its share through the update; a sleeping one or HF generate's cache only while sampling
    phase = engine + parts["activations"] if sampler == "vllm" else max(engine, parts["activations"])
    parts["total"] = parts["base"] + parts["adapter"] + parts["overhead"] + phase
    return parts


SAMPLERS = {"vllm": "vLLM", "vllm_sleep": "vLLM asleep in the update", "hf": "HF generate"}


def options(gpus: int) -> list[tuple[str, dict]]:
    """Settings in the order the table prefers them: the exact model before the 4-bit one (QLoRA changes the
    numbers), and for each, vLLM awake, vLLM asleep during the update, then HF generate (the slowest rollout);
    plain LoRA, then gradient checkpointing; on several GPUs also vLLM tensor-parallel over them, and FSDP with
    HF generate (FSDP with in-process vLLM is refused: each rank's push reads whole weights; a vLLM server on GPUs of
    its own, sampler=vllm_server, is outside this plan of the trainer's GPUs)."""
    exact = [("LoRA", {}), ("LoRA + checkpointing", {"checkpointing": True})]
    if gpus > 1:
        exact += [("LoRA + checkpointing", {"checkpointing": True, "tp": gpus}),
                  (f"FSDP x{gpus} + checkpointing", {"fsdp_ranks": gpus, "checkpointing": True})]
    quant = [("QLoRA + checkpointing", {"quant4": True, "checkpointing": True})]
    out = []
    for kinds in (exact, quant):
        for sampler in SAMPLERS:
            for name, kwargs in kinds:
                if ("tp" in kwargs and sampler == "hf") or ("fsdp_ranks" in kwargs and sampler != "hf"):
                    continue
                out.append((name, {**kwargs, "sampler": sampler}))
    return out


def first_fit(m: Arch, job: Job, gpu_gb: float, gpus: int) -> tuple[str, float] | None:
    """The first of `options` whose per-rank total fits `gpu_gb`: (its name and sampler, GB)."""
    for name, kwargs in options(gpus):
        total = per_rank_gb(m, job, **kwargs)["total"]
        if total <= gpu_gb:
            tp = kwargs.get("tp", 1)
            engine = SAMPLERS[kwargs["sampler"]] + (f", TP {tp}" if tp > 1 and kwargs["sampler"] != "hf" else "")
            return f"{name}; {engine}", total
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts-per-rank", type=int, default=Job.prompts_per_rank)
    ap.add_argument("--group-size", type=int, default=Job.group_size)
    ap.add_argument("--prompt-tokens", type=int, default=Job.prompt_tokens)
    ap.add_argument("--new-tokens", type=int, default=Job.new_tokens)
    ap.add_argument("--gpus", default="1x24,1x80,8x80", help="GPU layouts: COUNTxGB, comma-separated")
    a = ap.parse_args()
    job = Job(a.prompts_per_rank, a.group_size, a.prompt_tokens, a.new_tokens)
    layouts = [tuple(int(x) for x in s.split("x")) for s in a.gpus.split(",")]
    print("| model | base bf16 | adapter + AdamW | bucket activations (checkpointed) | vLLM weights + KV | "
          + " | ".join(f"{n} x {gb} GB" for n, gb in layouts) + " |")
    print("|---" * (5 + len(layouts)) + "|")
    for m in MODELS:
        p = per_rank_gb(m, job)
        fits = []
        for n, gb in layouts:
            fit = first_fit(m, job, gb, n)
            fits.append(f"{fit[0]} ({fit[1]:.0f} GB)" if fit else "does not fit")
        print(f"| {m.name} | {p['base']:.1f} | {p['adapter']:.2f} | {p['activations']:.1f} "
              f"({activations_gb(m, job, True):.1f}) | {p['rollout']:.1f} | " + " | ".join(fits) + " |")


if __name__ == "__main__":
    main()
