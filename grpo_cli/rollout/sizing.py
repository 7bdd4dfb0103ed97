"""The vLLM engine's sizes from the job, where the config leaves them null: its longest sequence
(`sampler.max_model_len`) and, on a CPU, its KV cache (`sampler.cpu_kv_cache_gb`).

    longest sequence = sampler.max_prompt_tokens + the job's max_new_tokens    (capped by the model's context)
    KV cache bytes   = blocks one engine call holds × BLOCK tokens × bytes a token × (1 + MARGIN_PERCENT/100)
    blocks           = prompts × min(n × blocks of the longest sequence,
                                     blocks of the prompt bound + n × blocks of (BLOCK - 1 + new tokens))
                       (a prompt's n samples share its full blocks through prefix caching; at least one longest
                       sequence, what vLLM needs to start)
    bytes a token    = 2 (K and V) × layers × KV heads × head size × bytes of the cache's dtype
    capped at        = MEMORY_PERCENT of the memory free when the engine starts (on a CPU), never below one
                       longest sequence

`max_prompt_tokens` and not the longest prompt of the data: every prompt is checked against it
(lengths.check_prompts), so no request can outgrow an engine sized from it mid-run, and it is known
before the data is read. The cache holds every sequence of one engine call at once (a step's prompts ×
group_size, cut by `sampler.batch_size` at whole groups as `Sampler.generate` cuts them); vLLM queues what
does not fit, so a smaller cache is slower, not wrong. That is also why the cap is safe: `grpo sample` of 500
prompts × 8 asks 72 GiB uncapped, which vLLM refuses on a 24 GiB machine, and gets the cap and a queue instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# tokens in one block of vLLM's paged KV cache on a CPU (its CPU platform's block_size, checked against the blocks
# an engine held: docs/sampling-vllm.md); whole blocks only
BLOCK = 128
# room beyond the sequences' own blocks, in percent (the scheduler's look-ahead slots, rounding)
MARGIN_PERCENT = 10
# the most of the memory free at the engine's start that a cache sized from the job takes, in percent: the trainer's
# own steps (activations, the optimizer) need the rest after the engine has taken its cache
MEMORY_PERCENT = 25


@dataclass(frozen=True)
class Job:
    """What one engine call of the command holds: `prompts` × `n` sequences of up to `max_new_tokens` new tokens
    (None: the sampler's own)."""

    prompts: int
    n: int = 1
    max_new_tokens: int | None = None


@dataclass(frozen=True)
class EngineSize:
    max_model_len: int
    kv_cache_bytes: int


def kv_bytes_per_token(config, dtype_bytes: int) -> int:
    """2 (K and V) × layers × KV heads × head size × bytes, from an HF model config."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * dtype_bytes


def engine_size(*, per_token: int, job: Job | None, max_prompt_tokens: int, max_new_tokens: int,
                batch_size: int | None, context: int | None, max_model_len: int | None,
                cpu_kv_cache_gb: float | None, free_bytes: int | None = None) -> EngineSize:
    """The engine's longest sequence and KV-cache bytes: the config's where it sets them, else sized from `job`
    (None: a caller that does not say; room for one sequence then, vLLM queues the rest) and capped at
    MEMORY_PERCENT of `free_bytes` (None: uncapped)."""
    new = (job.max_new_tokens if job and job.max_new_tokens else None) or max_new_tokens
    length = max_model_len or min(max_prompt_tokens + new, context or math.inf)
    if cpu_kv_cache_gb is not None:
        return EngineSize(int(length), int(cpu_kv_cache_gb * 2**30))
    prompts, n = (job.prompts, job.n) if job else (1, 1)
    if batch_size is not None:  # Sampler.generate sends at most batch_size // n prompts a call, at least one
        prompts = min(prompts, max(1, batch_size // n))
    prompts, n = max(1, prompts), max(1, n)
    # a prompt's n samples share its full blocks (prefix caching); each sample holds the prompt's partial last
    # block and its new tokens: at most ceil((BLOCK - 1 + new) / BLOCK) blocks of its own. Unshared (n = 1, or
    # when that is less), each sequence holds whole blocks of the longest sequence
    prompt = max(0, int(length) - new)
    shared = math.ceil(prompt / BLOCK) + n * math.ceil((BLOCK - 1 + new) / BLOCK)
    blocks = prompts * min(n * math.ceil(length / BLOCK), shared)
    tokens = blocks * BLOCK
    if free_bytes is not None:  # whole blocks, at least one longest sequence's (vLLM will not start with less)
        floor = math.ceil(length / BLOCK) * BLOCK
        tokens = min(tokens, max(floor, free_bytes * MEMORY_PERCENT // 100 // per_token // BLOCK * BLOCK))
    return EngineSize(int(length), -(-tokens * per_token * (100 + MARGIN_PERCENT) // 100))  # integer ceil
