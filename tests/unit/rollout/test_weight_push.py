"""What the vLLM sampler pushes to its engine: LoRA's merged layers, or (model.finetune=full) every weight; and the
adapter folder both vLLM samplers write (`rollout.adapter.write_adapter`: the server's push, the in-process
engine's with sampler.weight_sync=adapter)."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo_cli.policy import build_policy
from grpo_cli.rollout.adapter import write_adapter
from grpo_cli.rollout.vllm import fingerprint, merged_weights
from tests.helpers.engines import needs_vllm, set_adapter
from tests.helpers.runs import sampler_settings, tiny_cfg


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


class FakeLLM:
    """The parts of vLLM's `LLM` the adapter push calls: its engine's LoRA table and `generate`'s LoRA request."""

    def __init__(self):
        self.llm_engine = self
        self.model_config = types.SimpleNamespace(max_model_len=64)  # the engine's longest sequence
        self.loaded: dict[int, object] = {}  # {lora_int_id: LoRARequest} the engine holds
        self.named: list = []  # the LoRA request of each generate call

    def add_lora(self, request) -> bool:
        self.loaded[request.lora_int_id] = request
        return True

    def remove_lora(self, lora_id: int) -> bool:
        return self.loaded.pop(lora_id, None) is not None

    def list_loras(self) -> set[int]:
        return set(self.loaded)

    def generate(self, requests, params, use_tqdm=False, lora_request=None):
        self.named.append(lora_request)
        return []


@needs_vllm
def test_the_adapter_push_names_a_new_id_per_version_and_removes_the_one_before():
    from grpo_cli.rollout.vllm import VLLMSampler

    policy, tokenizer, _ = build_policy(tiny_cfg().model)
    s = VLLMSampler(**sampler_settings("vllm", weight_sync="adapter"))
    s.llm = FakeLLM()  # a started engine
    s.sync(policy)  # a fresh adapter (lora_B = 0) is still the policy's: version 1
    first = s._lora
    assert first.lora_int_id == 1 and s.llm.list_loras() == {1}
    assert sorted(p.name for p in Path(first.lora_path).iterdir()) == ["adapter_config.json",
                                                                        "adapter_model.safetensors"]
    assert s.last_push["bytes"] == sum(p.numel() * 4 for n, p in policy.named_parameters() if "lora_" in n)
    s.sync(policy)  # nothing changed: nothing written, the same request
    assert s._lora is first
    set_adapter(policy, seed=1)
    s.sync(policy)
    second = s._lora
    assert (second.lora_int_id, second.lora_name) == (2, f"{first.lora_name[:-1]}2") and s.llm.list_loras() == {2}
    assert not Path(first.lora_path).exists()  # the engine read its files when it loaded it
    with policy.disable_adapter():  # eval's base pass: requests name no adapter, nothing pushed
        s.sync(policy)
        s._run([{"prompt_token_ids": [1]}], [None])
    s.sync(policy)  # back from the base pass: the version the engine still holds
    s._run([{"prompt_token_ids": [1]}], [None])
    s.engine(policy, tokenizer, greedy=True, generator=None).continue_batch([[1, 2]], 4)  # multi-turn episodes
    assert s.llm.named == [None, second, second] and s.llm.list_loras() == {2}
