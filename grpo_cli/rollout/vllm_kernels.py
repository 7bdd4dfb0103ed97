"""vLLM's fused CPU RMSNorm kernels for its eager model on a CPU (`fused_cpu_norms`, applied by the vLLM engine).

vLLM 0.32 dispatches RMSNorm through its op registry, where the fused C++ kernels of its own build
(`_C::rms_norm`, `_C::fused_add_rms_norm`) are registered for GPUs only: on an x86 CPU every norm of every decode
step runs as several torch ops plus the registry's Python dispatch. This module points each norm of the engine's
model at the fused kernels instead, the same formula in one pass. A norm the kernels do not cover (a variance over
part of the hidden size, no weight, a weight in another dtype than its input, a non-contiguous input) keeps vLLM's
own path, call by call. SiLU-and-mul is left to vLLM's torch ops. What each choice measured: docs/speed.md.
"""

from __future__ import annotations

import functools

import torch


def fused_cpu_norms(model) -> int:
    """Point every RMSNorm of vLLM's `model` (inside the engine, `LLM.apply_model`) at vLLM's fused CPU kernels;
    returns how many. A no-op (0) where vLLM's build lacks them."""
    from vllm.model_executor.layers.layernorm import RMSNorm

    if not (hasattr(torch.ops._C, "rms_norm") and hasattr(torch.ops._C, "fused_add_rms_norm")):
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, RMSNorm) and module.has_weight and module.variance_size_override is None:
            module._forward_method = functools.partial(_fused, module, module._forward_method)
            count += 1
    return count


def _fused(module, vllm_forward, x: torch.Tensor, residual: torch.Tensor | None = None):
    """RMSNorm (x + residual, when given: vLLM's (normed, new residual), both written in place as its own fused
    path does) with one kernel; vLLM's own forward for what the kernel does not take."""
    weight = module.weight.data  # [D]
    if weight.dtype != x.dtype or not x.is_contiguous() or (residual is not None and not residual.is_contiguous()):
        return vllm_forward(x, residual)
    if residual is None:
        out = torch.empty_like(x)  # [tokens, D]
        torch.ops._C.rms_norm(out, x, weight, module.variance_epsilon)
        return out
    torch.ops._C.fused_add_rms_norm(x, residual, weight, module.variance_epsilon)  # residual += x; x = norm(residual)
    return x, residual
