"""What the vLLM sampler pushes to its engine: LoRA's merged layers, or (model.finetune=full) every weight; and the
adapter folder both vLLM samplers write (`rollout.adapter.write_adapter`: the server's push, the in-process
engine's with sampler.weight_sync=adapter)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from grpo_cli.policy import build_policy
from grpo_cli.rollout.adapter import write_adapter
from grpo_cli.rollout.vllm import fingerprint, merged_weights
from tests.helpers import set_adapter, tiny_cfg


def test_a_full_policy_pushes_every_weight_and_a_change_in_any_is_seen():
    policy, _, _ = build_policy(tiny_cfg("model.finetune=full").model)
    with torch.no_grad():
        policy.model.norm.weight.add_(0.5)  # a weight no LoRA layer holds
    pushed = merged_weights(policy, {"qkv_proj": ["q_proj", "k_proj", "v_proj"]})
    own = dict(policy.named_parameters())
    assert pushed.keys() == own.keys()  # embeddings, norms, every linear layer (the tied head as the embeddings)
    assert all(torch.equal(pushed[k], own[k].detach()) for k in own)

    before = fingerprint(policy)
    with torch.no_grad():
        policy.model.layers[1].post_attention_layernorm.weight.mul_(1.01)
    assert fingerprint(policy) != before  # the next sync pushes again


def test_the_active_adapter_is_written_as_a_peft_folder_with_its_bytes(tmp_path):
    policy, _, _ = build_policy(tiny_cfg().model)
    set_adapter(policy, seed=1)
    sent = write_adapter(policy, tmp_path)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    saved = load_file(tmp_path / "adapter_model.safetensors")
    own = {n.replace(".default.", "."): p.detach() for n, p in policy.named_parameters() if "lora_" in n}
    assert saved.keys() == own.keys() and all(torch.equal(saved[k], own[k]) for k in own)  # peft's own layout
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["r"] == policy.peft_config["default"].r and config["peft_type"] == "LORA"
    assert sent == sum(v.numel() * v.element_size() for v in saved.values())  # fp32 A and B of every layer

    policy.add_adapter("other", policy.peft_config["default"])
    policy.base_model.set_adapter(["default", "other"])  # two adapters active at once: no single folder holds them
    with pytest.raises(NotImplementedError, match="one active adapter"):
        write_adapter(policy, tmp_path / "two")
