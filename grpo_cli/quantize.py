"""QLoRA's base: `model.quantization=4bit` stores the base model's linear layers in bitsandbytes NF4.

    pip install -e '.[qlora]'                                   # bitsandbytes (make install has it)
    grpo train model.quantization=4bit                          # the default job on a 4-bit base

What is quantized: every `torch.nn.Linear` of the base except the output head (lm_head, often tied
to the input embeddings), as QLoRA does: NF4 with double quantization (the per-block scales are
quantized too), computing in the model's dtype (`model.dtype`). Embeddings, norms and the head stay
in `model.dtype`; the LoRA weights are peft's (fp32), trained as on a full-precision base.

Where it departs from the usual recipe (`from_pretrained(quantization_config=BitsAndBytesConfig(...))`
then peft's `prepare_model_for_kbit_training`):
  - the base is loaded by its own loader into host memory in `model.dtype`, then each linear layer is
    quantized as it moves to the device (`quantize_4bit`). One path for every loader, the tiny model
    built in memory included; the device never holds the full-precision weights, host memory does
    for a moment.
  - no `prepare_model_for_kbit_training`: it casts every non-4-bit weight to fp32 and turns on
    gradient checkpointing. Here those weights keep `model.dtype` and forwards run under
    `policy.autocast` as without quantization; gradient checkpointing stays `trainer.gradient_checkpointing`.

Full precision where a 4-bit weight leaves the policy: vLLM starts from dequant(W) written to a
temporary folder (`full_state_dict`), so also the layers no adapter touches hold what the policy
computes with, and each push sends dequant(W) + ΔW (`full_weight`). `grpo export` merges
dequant(W) + ΔW in float32 (`merge_dequantized`), where peft's `merge_and_unload` would quantize the
sum back to 4 bits.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

import torch
from omegaconf import DictConfig
from packaging.version import Version
from peft.tuners.lora import LoraLayer

from grpo_cli.checks import Check, Rule, get

# `model.quantization` values besides null
QUANTIZATIONS = ("4bit",)

# a CPU needs bitsandbytes' CPU backend: 0.50.2 ran NF4 forward + backward through LoRA here, older releases were
# not tried; CUDA needs only a release with Linear4bit
CPU_BITSANDBYTES = Version("0.50")
INSTALL = "pip install -e '.[qlora]' (bitsandbytes; make install has it)"


def quantize_4bit(model, device: torch.device):
    """`model` with each linear layer but the output head replaced by an NF4 `Linear4bit` on `device`.

    The source weights may sit anywhere (host memory, to keep them off the device); a layer's weight is
    quantized when it moves to `device`, in blocks of 64 values, each block with its absmax scale, the
    scales quantized again to 8 bits in blocks of 256 (double quantization).
    """
    import bitsandbytes as bnb

    head = model.get_output_embeddings()
    for name, module in list(model.named_modules()):
        if type(module) is not torch.nn.Linear or module is head:
            continue
        weight = module.weight.detach()  # [out, in], model.dtype
        layer = bnb.nn.Linear4bit(module.in_features, module.out_features, bias=False, compute_dtype=weight.dtype,
                                  compress_statistics=True, quant_type="nf4", device="meta")
        layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, compress_statistics=True, quant_type="nf4")
        # bitsandbytes' CPU inference path (an AVX512-BF16 CPU, eval mode, no grad) repacks the weight in place and
        # multiplies in bf16 whatever compute_dtype says, then serves training forwards from the repacked weight
        # too; it failed here on layers narrower than a block (RuntimeError: shape '[32, 0]' is invalid). Off: every
        # forward is dequant(W) in compute_dtype, the same numbers for sampling, scoring and training
        layer.support_avx512bf16_for_cpu = False
        if module.bias is not None:
            layer.bias = torch.nn.Parameter(module.bias.detach(), requires_grad=False)
        model.set_submodule(name, layer.to(device))
    # peft wraps a Linear4bit in its 4-bit LoRA layer only when the model says it is loaded in 4 bits
    model.is_loaded_in_4bit = True
    return model


def is_4bit(module: torch.nn.Module) -> bool:
    """The module holds a bitsandbytes 4-bit weight itself (a peft LoRA layer only points at its base layer's)."""
    return type(module._parameters.get("weight")).__name__ == "Params4bit"


def full_weight(module: torch.nn.Module) -> torch.Tensor:
    """A linear layer's weight in full precision: dequant(W) of a 4-bit layer ([out, in], in the dtype it was
    quantized from), else W itself."""
    if not is_4bit(module):
        return module.weight.detach()
    import bitsandbytes.functional as bnb_functional

    weight = module.weight
    return bnb_functional.dequantize_4bit(weight.data, weight.quant_state)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with each 4-bit weight dequantized and its quantization constants (absmax, the
    NF4 code, the nested scales: keys under `NAME.weight.`) dropped: what a full-precision model loads."""
    state = dict(model.state_dict())
    for name, module in model.named_modules():
        if is_4bit(module):
            for key in [k for k in state if k.startswith(f"{name}.weight.")]:
                del state[key]
            state[f"{name}.weight"] = full_weight(module)
    return state


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.nn.Linear:
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        layer.bias = torch.nn.Parameter(bias.detach().to(weight.dtype), requires_grad=False)
    return layer


@torch.no_grad()
def merge_dequantized(policy):
    """The base model of a LoRA `policy` on a 4-bit base, as plain float32 linear layers: dequant(W) + ΔW
    (each active adapter's) for an adapted layer, dequant(W) for every other 4-bit layer."""
    base = policy.get_base_model()
    for name in [n for n, m in base.named_modules() if isinstance(m, LoraLayer)]:
        layer = base.get_submodule(name)
        inner = layer.get_base_layer()
        weight = full_weight(inner).float()  # [out, in]
        if not layer.disable_adapters:
            for adapter in [a for a in layer.active_adapters if a in layer.lora_A]:
                weight = weight + layer.get_delta_weight(adapter).float()
        base.set_submodule(name, _linear(weight, inner.bias))
    for name in [n for n, m in base.named_modules() if is_4bit(m)]:
        module = base.get_submodule(name)
        base.set_submodule(name, _linear(full_weight(module).float(), module.bias))
    base.is_loaded_in_4bit = False
    return base


# ---- config checks: model.quantization, collected by config.validate through policy.CHECKS -----------------

def _on_cpu(device) -> bool:
    return device == "cpu" or (device == "auto" and not torch.cuda.is_available())


def check_bitsandbytes(cfg: DictConfig) -> list[str]:
    """model.quantization=4bit needs bitsandbytes, and on a CPU one whose CPU backend runs NF4 (before any
    model loads)."""
    if get(cfg, "model.quantization")[1] not in QUANTIZATIONS:
        return []
    if importlib.util.find_spec("bitsandbytes") is None:
        return [f"model.quantization=4bit needs bitsandbytes, which is not installed: {INSTALL}; "
                f"or set model.quantization=null"]
    version = Version(importlib.metadata.version("bitsandbytes"))
    if _on_cpu(get(cfg, "model.device")[1]) and version < CPU_BITSANDBYTES:
        return [f"model.quantization=4bit on a CPU needs bitsandbytes >= {CPU_BITSANDBYTES} (its CPU backend; "
                f"{version} is installed): pip install -U 'bitsandbytes>={CPU_BITSANDBYTES}'; or run on a CUDA GPU; "
                f"or set model.quantization=null"]
    return []


CHECKS: list[Check] = [
    Rule("model.quantization", lambda v: v is None or v in QUANTIZATIONS,
         "must be 4bit (QLoRA: an NF4 base) or null (no quantization); set model.quantization=null"),
    check_bitsandbytes,
]
