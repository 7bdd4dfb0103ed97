"""model.quantization=4bit (QLoRA): an NF4 base that stays frozen while LoRA trains, full-precision weights
wherever they leave the policy (the vLLM push and folder, export), and config errors that name the fix.

The tests that build a 4-bit model skip without bitsandbytes (pip install -e '.[qlora]'; make install has it).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from grpo_cli import checkpoint, quantize
from grpo_cli.commands import export, train
from grpo_cli.config import compose, validate
from grpo_cli.errors import ConfigError
from grpo_cli.instantiate import build
from grpo_cli.policy import build_policy, load_tiny_random
from grpo_cli.rollout.vllm import VLLMSampler, merged_weights
from tests.helpers.engines import PROMPTS, hf_greedy, needs_vllm, set_adapter
from tests.helpers.runs import metrics, sampler_settings, tiny_cfg

needs_bnb = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                               reason="bitsandbytes is not installed: pip install -e '.[qlora]'")
FOUR_BIT = "model.quantization=4bit"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_4bit():
    torch.manual_seed(0)  # the LoRA A init
    return build_policy(compose("train", ["model=tiny", FOUR_BIT]).model)[:2]


def randomize_lora(policy):
    """LoRA B starts at zero (ΔW = 0); random B makes ΔW visible."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def test_quantization_is_null_by_default_and_checked():
    assert compose("train").model.quantization is None
    assert compose("train", ["model=tiny"]).model.quantization is None
    assert compose("train", ["model=hf", "model.name_or_path=x"]).model.quantization is None
    with pytest.raises(ConfigError, match=r"model.quantization \('8bit'\) must be 4bit .*model.quantization=null"):
        validate(compose("train", ["model=tiny", "model.quantization=8bit"]))


def test_4bit_without_bitsandbytes_names_the_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name))
    with pytest.raises(ConfigError, match=r"model.quantization=4bit needs bitsandbytes, which is not installed: "
                                          r"pip install -e '.\[qlora\]'.*or set model.quantization=null"):
        validate(compose("train", ["model=tiny", FOUR_BIT]))


def test_4bit_on_a_cpu_with_an_old_bitsandbytes_names_the_upgrade(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setattr(quantize.importlib.metadata, "version", lambda name: "0.45.5")
    with pytest.raises(ConfigError, match=r"on a CPU needs bitsandbytes >= 0.50 .*0.45.5 is installed.*"
                                          r"pip install -U 'bitsandbytes>=0.50'.*CUDA GPU.*model.quantization=null"):
        validate(compose("train", ["model=tiny", FOUR_BIT]))


@needs_bnb
def test_a_grpo_process_imports_peft_with_bitsandbytes_installed_without_a_log_line():
    # peft imports bitsandbytes whenever it is installed; its CPU backend logs a missing optional kernel package
    code = "from grpo_cli.cli import setup_process; setup_process(); import peft"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stderr == ""


@needs_bnb
def test_the_base_is_nf4_with_double_quant_frozen_and_lora_gets_the_gradient():
    policy, tokenizer = tiny_4bit()
    base = policy.get_base_model()
    for layer in base.model.layers:
        for proj in (*[getattr(layer.self_attn, p) for p in PROJECTIONS[:4]],
                     *[getattr(layer.mlp, p) for p in PROJECTIONS[4:]]):
            weight = proj.get_base_layer().weight if hasattr(proj, "get_base_layer") else proj.weight
            assert type(weight).__name__ == "Params4bit" and not weight.requires_grad
            assert weight.quant_state.quant_type == "nf4" and weight.quant_state.nested  # double quantization
            assert weight.quant_state.dtype == torch.float32  # computes in model.dtype (tiny: float32)
    # embeddings and the (tied) head stay in model.dtype
    assert base.get_input_embeddings().weight.dtype == torch.float32
    assert type(base.get_output_embeddings().weight).__name__ == "Parameter"

    ids = torch.tensor([tokenizer("What is 2+3?").input_ids])
    policy(input_ids=ids).logits.sum().backward()
    grads = {n: p.grad for n, p in policy.named_parameters() if p.grad is not None}
    assert grads and all("lora_" in n for n in grads)
    assert any(g.abs().sum() > 0 for n, g in grads.items() if "lora_B" in n)  # B gets the gradient first (A·x ≠ 0)


@needs_bnb
def test_the_4bit_base_computes_what_its_dequantized_weights_compute():
    # NF4 rounds each weight to one of 16 levels x its block's absmax; a full-precision model holding dequant(W)
    # must give the same logits, which is what vLLM and export are handed
    policy, tokenizer = tiny_4bit()
    plain, _ = load_tiny_random()
    plain.load_state_dict({k.replace(".base_layer.", "."): v for k, v in
                           quantize.full_state_dict(policy.get_base_model()).items() if "lora_" not in k})
    ids = torch.tensor([tokenizer("What is 2+3?").input_ids])
    with torch.no_grad(), policy.disable_adapter():
        quantized = policy(input_ids=ids).logits
    torch.testing.assert_close(plain(input_ids=ids).logits, quantized, rtol=1e-5, atol=1e-5)
    # and they are not the original weights: the quantization did something
    original, _ = load_tiny_random()
    assert not torch.allclose(original(input_ids=ids).logits, quantized, atol=1e-3)


@needs_bnb
def test_the_vllm_push_is_dequantized_w_plus_delta_and_the_folder_full_precision(tmp_path):
    import bitsandbytes.functional as bnb_functional

    policy, _ = tiny_4bit()
    randomize_lora(policy)
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    weights = merged_weights(policy, packed)
    attn = policy.get_base_model().model.layers[0].self_attn
    q = attn.q_proj
    dequant = bnb_functional.dequantize_4bit(q.base_layer.weight.data, q.base_layer.weight.quant_state)  # [32, 32]
    delta = q.lora_B["default"].weight @ q.lora_A["default"].weight * (8 / 4)  # B·A·alpha/r, tiny: alpha 8, r 4
    torch.testing.assert_close(weights["model.layers.0.self_attn.q_proj.weight"], dequant + delta)
    # k_proj carries no adapter but is fused with q and v in vLLM: its weight goes too, dequantized
    k = attn.k_proj.weight
    assert torch.equal(weights["model.layers.0.self_attn.k_proj.weight"],
                       bnb_functional.dequantize_4bit(k.data, k.quant_state))
    assert all(w.dtype == torch.float32 and w.shape == (32, 32) for n, w in weights.items() if "self_attn" in n)

    # the folder vLLM starts from: full-precision dequant(W), no quantization constants
    sampler = VLLMSampler(**sampler_settings("vllm"))
    folder = sampler.model_folder(policy)
    state = load_file(folder / "model.safetensors")
    assert not [k for k in state if ".weight." in k or "lora_" in k or "base_layer" in k]
    assert {v.dtype for v in state.values()} == {torch.float32}
    key = "model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(state[key], weights[key])
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())


@needs_bnb
def test_one_step_on_a_4bit_base_trains_lora_and_the_checkpoint_reloads(tmp_path):
    cfg = tiny_cfg("trainer.max_steps=1", "trainer.save_every=1", FOUR_BIT)
    last = train.run(cfg, tmp_path)
    assert [r["step"] for r in metrics(tmp_path)] == [1]

    # the checkpoint holds the adapter only, as safetensors, and it moved
    adapter = load_file(last / "adapter_model.safetensors")
    assert adapter and all("lora_" in k for k in adapter)
    assert any(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)
    assert checkpoint.load_config(last).model.quantization == "4bit"

    # it reloads onto a fresh 4-bit base: the adapter weights come back exactly, the base is 4-bit again
    policy, tokenizer, _ = build_policy(cfg.model)
    checkpoint.load_adapter(policy, last)
    state = policy.state_dict()
    for key, value in adapter.items():
        assert torch.equal(state[key.replace(".weight", ".default.weight")], value), key
    q = policy.get_base_model().model.layers[0].self_attn.q_proj
    assert type(q.base_layer.weight).__name__ == "Params4bit"


@needs_bnb
def test_export_merges_dequantized_w_plus_delta_into_a_plain_model(tmp_path):
    run_dir = tmp_path / "run"
    last = train.run(tiny_cfg("trainer.max_steps=1", "trainer.save_every=1", FOUR_BIT), run_dir)
    out = export.run(compose("export", [f"checkpoint={run_dir}", f"output={tmp_path / 'merged'}"]))
    record = json.loads((out / "export.json").read_text())
    assert record["quantization"] == "4bit" and record["merged"] and record["dtype"] == "float32"
    assert "quantization_config" not in json.loads((out / "config.json").read_text())

    # plain transformers (no bitsandbytes layer) computes what the trained 4-bit policy computes
    model = AutoModelForCausalLM.from_pretrained(out)
    assert not any(quantize.is_4bit(m) for m in model.modules())
    policy, tokenizer, _ = build_policy(checkpoint.load_config(last).model)
    checkpoint.load_adapter(policy, last)
    policy.eval()
    ids = torch.tensor([tokenizer("What is 2+3?").input_ids])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, policy(input_ids=ids).logits, rtol=1e-4, atol=1e-4)

    # the adapter export: LoRA weights only, the base named as the run's (full precision)
    adapter = export.run(compose("export", [f"checkpoint={run_dir}", f"output={tmp_path / 'adapter'}",
                                            "export.merge=false"]))
    written = load_file(Path(adapter) / "adapter_model.safetensors")
    assert set(written) == set(load_file(last / "adapter_model.safetensors"))


@needs_bnb
@needs_vllm
@pytest.mark.slow
def test_vllm_on_a_4bit_smollm2_samples_what_the_policy_computes():
    """The embedded SmolLM2 on a 4-bit base, sampled by vLLM's CPU build: greedy answers equal HF generate's on
    the 4-bit policy and the log-prob gap is as small as without quantization, so vLLM holds dequant(W) + ΔW."""
    from grpo_cli.logprobs import sequence_logprobs
    from grpo_cli.rollout import render_prompts

    policy, tokenizer, _ = build_policy(compose("train", [FOUR_BIT]).model)
    policy.eval()
    prompts = render_prompts(tokenizer, PROMPTS)
    sampler = build(compose("train", ["sampler=vllm", "sampler.max_new_tokens=24", FOUR_BIT]).sampler)
    set_adapter(policy, 1)
    sampler.sync(policy)
    assert sampler.llm is not None and sampler.fallback is None
    ours = sampler.generate(policy, tokenizer, prompts, 1, greedy=True)
    theirs = hf_greedy(policy, tokenizer, prompts)
    assert ours.texts == theirs.texts, (ours.texts, theirs.texts)
    with torch.no_grad():
        trainer = sequence_logprobs(policy, ours).logp  # [N, T]
    gap = (trainer - ours.sampling_logp)[ours.completion_mask.bool()].abs()
    print(f"4-bit SmolLM2: mean |vLLM - trainer| log-prob {gap.mean():.2e}, max {gap.max():.2e}")
    assert gap.mean() < 1e-3 and gap.max() < 1e-2


# ---- on a GPU (pytest -m cuda; skipped without one) -------------------------------------------------------

@pytest.mark.cuda
@needs_bnb
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_4bit_base_in_bf16_trains_lora_and_pushes_dequantized_weights(tmp_path):
    cfg = tiny_cfg("trainer.max_steps=1", "trainer.save_every=1", FOUR_BIT, "model.device=cuda",
                   "model.dtype=bfloat16")
    last = train.run(cfg, tmp_path)
    assert any(v.abs().sum() > 0 for k, v in load_file(last / "adapter_model.safetensors").items() if "lora_B" in k)
    policy, _, _ = build_policy(cfg.model)
    q = policy.get_base_model().model.layers[0].self_attn.q_proj
    weight = q.base_layer.weight
    assert type(weight).__name__ == "Params4bit" and weight.device.type == "cuda" and weight.dtype == torch.uint8
    assert weight.quant_state.dtype == torch.bfloat16 and q.lora_A["default"].weight.dtype == torch.float32
    pushed = merged_weights(policy, {})["model.layers.0.self_attn.q_proj.weight"]
    assert pushed.dtype == torch.bfloat16 and pushed.device.type == "cuda" and pushed.shape == (32, 32)
