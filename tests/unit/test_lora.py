"""The lean LoRA forward (grpo_cli.lora) computes peft's function: outputs and gradients, every path."""

from __future__ import annotations

import copy

import pytest
import torch

from grpo_cli import lora
from grpo_cli.policy import apply_lora, keep_reference, load_tiny_random, reference, set_reference

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def policies(dropout: float = 0.0):
    """(peft's policy, the same weights with the lean forward), LoRA B randomized so the adapter matters."""
    model, _ = load_tiny_random(seed=3)
    torch.manual_seed(0)
    plain = apply_lora(model, 4, 8, dropout, TARGETS)
    for name, p in plain.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.1)
    # apply_lora gives the lean forward; the plain twin goes back to peft's class
    lean = copy.deepcopy(plain)
    for module in plain.modules():
        if type(module) is lora.LeanLinear:
            module.__class__ = lora.LoraLinear
    return plain, lean


def run(policy, ids):
    policy.zero_grad()
    logits = policy(input_ids=ids).logits  # [B, T, V]
    (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.requires_grad}
    return logits.detach(), grads


def test_apply_lora_gives_every_plain_lora_linear_the_lean_forward():
    _, lean = policies()
    kinds = {type(m) for m in lean.modules() if "lora" in type(m).__module__ or type(m) is lora.LeanLinear}
    assert lora.LeanLinear in kinds and lora.LoraLinear not in kinds
    assert sum(type(m) is lora.LeanLinear for m in lean.modules()) == 2 * len(TARGETS)  # 2 layers x 7


def test_lean_forward_matches_peft_outputs_and_gradients():
    plain, lean = policies()
    ids = torch.randint(3, 40, (3, 11), generator=torch.Generator().manual_seed(1))
    (a, ga), (b, gb) = run(plain, ids), run(lean, ids)
    assert torch.allclose(a, b, atol=1e-5)
    assert ga.keys() == gb.keys() and len(ga) == 4 * len(TARGETS)
    assert all(torch.allclose(ga[k], gb[k], atol=1e-5, rtol=1e-4) for k in ga)
    # the adapter matters here: without it the logits differ
    with torch.no_grad(), plain.disable_adapter():
        assert not torch.allclose(plain(input_ids=ids).logits, a, atol=1e-3)


def test_lean_forward_off_and_reference_adapter_paths_are_peft_s():
    plain, lean = policies()
    ids = torch.randint(3, 40, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        with plain.disable_adapter(), lean.disable_adapter():  # the reference of a plain run: the base
            assert torch.equal(plain(input_ids=ids).logits, lean(input_ids=ids).logits)
        set_reference(plain), set_reference(lean)  # iterative RL: a second adapter, active in `reference`
        for p in (plain, lean):
            for name, w in p.named_parameters():
                if ".default." in name and "lora_B" in name:
                    w.add_(0.05)  # the policy moves on; the reference keeps the copy
        with reference(plain), reference(lean):
            assert torch.allclose(plain(input_ids=ids).logits, lean(input_ids=ids).logits, atol=1e-5)
        assert torch.allclose(plain(input_ids=ids).logits, lean(input_ids=ids).logits, atol=1e-5)


def test_lean_forward_with_dropout_in_eval_mode_matches():
    plain, lean = policies(dropout=0.3)
    plain.eval(), lean.eval()
    ids = torch.randint(3, 40, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.allclose(plain(input_ids=ids).logits, lean(input_ids=ids).logits, atol=1e-5)


def test_a_base_in_another_precision_takes_peft_s_forward_and_runs_the_base_once():
    # a bf16 base under fp32 adapters, outside autocast: peft's promotion rules, its output, one base matmul
    plain, lean = policies()
    for p in (plain, lean):
        p.base_model.model.model.layers.to(torch.bfloat16)
        for name, w in p.named_parameters():
            if "lora_" in name:
                w.data = w.data.float()
    calls = []
    layer = next(m for m in lean.modules() if type(m) is lora.LeanLinear)
    layer.base_layer.register_forward_hook(lambda *_: calls.append(1))
    x = torch.randn(3, layer.in_features, dtype=torch.bfloat16)
    twin = next(m for m in plain.modules() if type(m) is lora.LoraLinear)
    with torch.no_grad():
        assert torch.equal(layer(x), twin(x))
    assert calls == [1]


def test_a_full_parameter_policys_frozen_reference_is_held_apart_from_it():
    # model.finetune=full with β > 0: the caller holds the frozen copy and hands it to `reference`; transformers'
    # object gets no attribute of ours, so parameters(), state_dict() and the checkpoint are the policy's alone
    policy, _ = load_tiny_random()
    policy.requires_grad_(True)
    attributes, weights = set(vars(policy)), set(policy.state_dict())
    frozen, line = keep_reference(policy, needed=True)
    assert set(vars(policy)) == attributes and set(policy.state_dict()) == weights
    assert line.startswith("model.finetune=full") and "frozen copy" in line
    assert not any(p.requires_grad for p in frozen.parameters())
    with reference(policy, frozen) as ref:
        assert ref is frozen
    with pytest.raises(RuntimeError, match="no reference"), reference(policy):
        pass
    # β = 0: no copy, said so; a LoRA policy: its reference is the adapter switched off, nothing to keep
    assert keep_reference(policy, needed=False)[0] is None
    assert keep_reference(apply_lora(load_tiny_random()[0], 4, 8, 0.0, ["q_proj"]), needed=True) == (None, None)
