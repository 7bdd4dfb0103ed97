"""model.quantization=4bit (QLoRA): an NF4 base that stays frozen while LoRA trains, full-precision weights
wherever they leave the policy (the vLLM push and folder, export), and config errors that name the fix.

The tests that build a 4-bit model skip without bitsandbytes (pip install -e '.[qlora]'; make install has it).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from safetensors.torch import load_file
from test_train import metrics, tiny_cfg

from grpo_cli import checkpoint, quantize
from grpo_cli.commands import train
from grpo_cli.config import compose, validate
from grpo_cli.errors import ConfigError
from grpo_cli.policy import build_policy, load_tiny_random

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
