"""What the vLLM sampler pushes to its engine: LoRA's merged layers, or (model.finetune=full) every weight."""

from __future__ import annotations

import torch

from grpo_cli.policy import build_policy
from grpo_cli.rollout.vllm import fingerprint, merged_weights
from tests.helpers import tiny_cfg


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
