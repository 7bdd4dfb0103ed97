"""The policy's LoRA adapter as vLLM loads one: the active adapter's peft folder (adapter_model.safetensors +
adapter_config.json), written for a vLLM engine to load as a new adapter version. Both vLLM samplers push it: the
server sampler every step (vllm_server.py), the in-process engine with `sampler.weight_sync=adapter` (vllm.py).
Also the peft layers both samplers read the adapters' state from (the fingerprint, the merged push).
"""

from __future__ import annotations

from pathlib import Path

import torch
from peft import get_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from safetensors.torch import save_file

from grpo_cli.rollout.vllm_engine import base_model


def lora_layers(policy) -> dict[str, torch.nn.Module]:
    """{HF module name (model.layers.0.self_attn.q_proj): peft LoRA layer} of the policy."""
    base = base_model(policy)
    return {name: module for name, module in base.named_modules() if isinstance(module, LoraLayer)}


def active(layer) -> list[str]:
    """The adapters a LoRA layer applies in its forward now ([] while adapters are off)."""
    if layer.disable_adapters or layer.merged:
        return []
    return [a for a in layer.active_adapters if a in layer.lora_A]


def adapter_rank(policy) -> int:
    """The largest rank of any adapter the policy holds (model.lora.r, or a warm start's; 0 without adapters)."""
    return max((r for layer in lora_layers(policy).values() for r in layer.r.values()), default=0)


def write_adapter(policy, folder: Path) -> int:
    """The policy's one active adapter as a peft folder in `folder` (made if missing), as vLLM's LoRA loader reads
    it; returns the bytes of its weights (fp32 A and B of each adapted layer: 19.5 MB for SmolLM2-135M's 7
    projections at r=16)."""
    names = sorted({a for layer in lora_layers(policy).values() for a in active(layer)})
    if len(names) != 1:  # vLLM applies one adapter per request: two active at once have no single folder
        raise NotImplementedError(f"the adapter push sends one active adapter, and the policy has {names}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    # the adapters' own weights, not policy.state_dict(): under trainer.fsdp that walks the sharded base and frees
    # the layers this rank holds gathered, on this rank alone (rank 0 writes), so the ranks' next gathers differ
    own = {name: p for name, p in policy.named_parameters() if "lora_" in name}
    weights = get_peft_model_state_dict(policy, state_dict=own, adapter_name=names[0])
    save_file({k: v.detach().cpu().contiguous() for k, v in weights.items()}, folder / "adapter_model.safetensors")
    policy.peft_config[names[0]].save_pretrained(folder)
    return sum(v.numel() * v.element_size() for v in weights.values())
