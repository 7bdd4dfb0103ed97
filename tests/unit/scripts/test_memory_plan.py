"""scripts/memory_plan.py's arithmetic (docs/multi-device.md's table), against numbers worked by hand."""

from __future__ import annotations

import pytest

from tests.helpers.scripts import load_script

plan = load_script("memory_plan")

# 1e9 parameters; hidden 4, 2 layers, 2 heads of 2, 1 KV head, MLP 8
TOY = plan.Arch("toy", 1e9, 4, 2, 2, 1, 2, 8)
JOB = plan.Job(prompts_per_rank=1, group_size=2, prompt_tokens=10, new_tokens=15, lora_r=1, bucket_rows=8)


def test_parts_by_hand():
    # per layer r x (in + out): q 4+4, k and v 4+2 each, o 4+4, gate and up 4+8 each, down 8+4 -> 64; 2 layers
    assert plan.adapter_params(TOY, 1) == 128
    # 8 rows x 25 tokens = 200; 34 x 4 bytes a token a layer (MLP 8 < 4 x 4: no widening) x 2 layers
    assert plan.activations_gb(TOY, JOB, checkpointing=False) == pytest.approx(200 * 136 * 2 / 1e9)
    # checkpointed: each layer's input (2 x 4 bytes) x 2 layers, plus one layer's 136 bytes, a token
    assert plan.activations_gb(TOY, JOB, checkpointing=True) == pytest.approx(200 * (16 + 136) / 1e9)
    # 1 prompt x G 2 x 25 tokens x K,V x 2 layers x 1 head x 2 dims x 2 bytes
    assert plan.kv_cache_gb(TOY, JOB) == pytest.approx(50 * 16 / 1e9)


def test_totals_by_hand():
    act, kv, adapter = 200 * 136 * 2 / 1e9, 800 / 1e9, 16 * 128 / 1e9
    awake = plan.per_rank_gb(TOY, JOB)
    # bf16 base 2 GB; vLLM's own 2 GB copy + KV, awake through the update beside the activations; 1.5 overhead
    assert awake["total"] == pytest.approx(2.0 + adapter + 1.5 + (2.0 + kv) + act)
    asleep = plan.per_rank_gb(TOY, JOB, sampler="vllm_sleep")
    assert asleep["total"] == pytest.approx(2.0 + adapter + 1.5 + max(2.0 + kv, act))
    hf = plan.per_rank_gb(TOY, JOB, sampler="hf")
    assert hf["total"] == pytest.approx(2.0 + adapter + 1.5 + max(kv, act))
    # FSDP over 4: a quarter of the 2 GB base, plus one of the 2 layers whole (1 GB)
    assert plan.per_rank_gb(TOY, JOB, fsdp_ranks=4)["base"] == pytest.approx(0.5 + 1.0)
    # NF4 with double quant: 0.516 byte a parameter
    assert plan.per_rank_gb(TOY, JOB, quant4=True)["base"] == pytest.approx(0.516)


def test_first_fit_prefers_the_fastest_setting_that_fits():
    # awake vLLM needs 2 + 1.5 + 2 GB and a little; without vLLM's copy 3.5 GB and a little
    assert plan.first_fit(TOY, JOB, 6, 1)[0] == "LoRA; vLLM"
    assert plan.first_fit(TOY, JOB, 4, 1)[0] == "LoRA; HF generate"
    # 4-bit with HF generate: 0.516 + 1.5 + a little
    assert plan.first_fit(TOY, JOB, 2.1, 1)[0] == "QLoRA + checkpointing; HF generate"
    assert plan.first_fit(TOY, JOB, 1.0, 1) is None
    # million-token prompts: a bucket's activations 8e6 tokens x 136 x 2 layers = 2.18 GB (checkpointed 8e6 x 152
    # = 1.22 GB); vLLM 2 GB + KV 2e6 x 16 bytes = 2.03 GB. Awake: LoRA 2 + 1.5 + 2.03 + 2.18 = 7.7 GB, checkpointed
    # 6.75 GB; asleep: 2 + 1.5 + max(2.03, 2.18) = 5.68 GB, checkpointed 5.53 GB; HF generate, checkpointed:
    # 2 + 1.5 + 1.22 = 4.72 GB
    long = plan.Job(prompts_per_rank=1, group_size=2, prompt_tokens=10**6, new_tokens=15, lora_r=1, bucket_rows=8)
    assert plan.first_fit(TOY, long, 7, 1)[0] == "LoRA + checkpointing; vLLM"
    assert plan.first_fit(TOY, long, 5.6, 1)[0] == "LoRA + checkpointing; vLLM asleep in the update"
    assert plan.first_fit(TOY, long, 5.0, 1)[0] == "LoRA + checkpointing; HF generate"
    assert plan.first_fit(TOY, long, 4.6, 1)[0] == "QLoRA + checkpointing; vLLM asleep in the update"  # 4.05 GB
    assert plan.first_fit(TOY, long, 3.5, 1)[0] == "QLoRA + checkpointing; HF generate"  # 0.516 + 1.5 + 1.22
    # 2 GPUs: vLLM TP 2 holds 1 GB + KV: 2 + 1.5 + 1.03 + 1.22 = 5.75 GB awake, checkpointed
    assert plan.first_fit(TOY, long, 5.8, 2)[0] == "LoRA + checkpointing; vLLM, TP 2"
    # 4 GPUs: FSDP (HF generate only) holds a quarter of the base (0.5 GB) plus one of 2 layers whole (1 GB):
    # 1.5 + 1.5 + 1.22 = 4.22 GB, under vLLM TP 4 asleep (2 + 1.5 + 1.22 = 4.72) and plain HF generate (4.72)
    assert plan.first_fit(TOY, long, 4.5, 4)[0] == "FSDP x4 + checkpointing; HF generate"
