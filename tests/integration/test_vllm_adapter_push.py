"""sampler.weight_sync=adapter: the in-process vLLM engine with LoRA enabled, the base weights loaded once and the
active adapter pushed as a peft folder under a new id per version. Config errors everywhere; with vLLM installed,
greedy completions on the embedded SmolLM2 equal the merged push's (and HF generate's) after each adapter push."""

from __future__ import annotations

import pytest
import torch

from grpo_cli.config import compose, validate
from grpo_cli.errors import ConfigError
from tests.helpers.engines import PROMPTS, hf_greedy, needs_vllm, set_adapter

# --------------------------------------------------------------------------- config, with or without vLLM


def errors(command: str, overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as err:
        validate(compose(command, overrides))
    return str(err.value).splitlines()


def test_weight_sync_is_merged_or_adapter_and_adapter_needs_a_lora_run(monkeypatch):
    monkeypatch.setattr("grpo_cli.rollout.vllm_engine.installed", lambda: True)
    assert compose("train", ["sampler=vllm"]).sampler.weight_sync == "merged"  # the default, until measured
    validate(compose("train", ["sampler=vllm", "sampler.weight_sync=adapter"]))
    validate(compose("eval", ["sampler=vllm", "sampler.weight_sync=adapter"]))
    validate(compose("train", ["sampler.weight_sync=adapter"]))  # sampler=auto composes vllm.yaml: the key is there
    assert errors("train", ["sampler=vllm", "sampler.weight_sync=delta"]) == [
        "sampler.weight_sync ('delta') must be merged or adapter; set sampler.weight_sync=merged"]
    assert errors("train", ["sampler=vllm", "sampler.weight_sync=adapter", "model.finetune=full"]) == [
        "sampler.weight_sync=adapter pushes a LoRA adapter, and model.finetune=full trains every weight (there is no "
        "adapter); set sampler.weight_sync=merged"]


def test_adapter_push_over_ranks_of_one_engine_is_refused(monkeypatch):
    monkeypatch.setattr("grpo_cli.rollout.vllm_engine.installed", lambda: True)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    train = ["sampler=vllm", "trainer.prompts_per_step=4"]
    validate(compose("train", [*train, "sampler.weight_sync=adapter"]))  # an engine per rank: each pushes its own
    assert errors("train", [*train, "sampler.weight_sync=adapter", "sampler.tensor_parallel_size=2"]) == [
        "sampler.weight_sync=adapter is not built for an engine over several ranks (sampler.tensor_parallel_size=2): "
        "set sampler.weight_sync=merged or sampler.tensor_parallel_size=1"]


def test_hf_generate_under_auto_drops_the_setting():
    from grpo_cli.rollout.engine import choose

    section = choose(compose("train", ["sampler.weight_sync=adapter"]).sampler, installed=False).section
    assert "weight_sync" not in section  # an engine-only setting, like dtype


# --------------------------------------------------------------------------- the engine (needs vLLM)

# vLLM's CPU LoRA path is its PyTorch reference kernels, uncompiled: 2 prompts and 16 tokens keep these tests short
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def smollm2():
    """(policy with a LoRA adapter, tokenizer, 2 prompts, a merged-push and an adapter-push vLLM sampler)."""
    from grpo_cli.instantiate import build
    from grpo_cli.policy import build_policy
    from grpo_cli.rollout import render_prompts

    policy, tokenizer, _ = build_policy(compose("train").model)
    policy.eval()
    settings = ["sampler=vllm", f"sampler.max_new_tokens={NEW_TOKENS}"]
    merged = build(compose("train", settings).sampler)
    adapter = build(compose("train", [*settings, "sampler.weight_sync=adapter"]).sampler)
    return policy, tokenizer, render_prompts(tokenizer, PROMPTS[:2]), merged, adapter


@needs_vllm
@pytest.mark.slow
def test_adapter_push_samples_what_the_merged_push_samples(smollm2, monkeypatch):
    from grpo_cli.rollout import vllm as module

    policy, tokenizer, prompts, merged, adapter = smollm2
    probed, real_probe = [], module.probe

    def probe(llm, vllm, lora=None):
        probed.append(lora)
        real_probe(llm, vllm, lora)

    monkeypatch.setattr(module, "probe", probe)
    set_adapter(policy, 1)  # lora_B nonzero: the adapter moves the greedy answers
    ours = adapter.generate(policy, tokenizer, prompts, 1, greedy=True)
    assert adapter.llm is not None and adapter.fallback is None
    assert [r.lora_name for r in probed] == [adapter._lora.lora_name]  # the start's one-token check used it
    theirs = merged.generate(policy, tokenizer, prompts, 1, greedy=True)
    assert ours.texts == theirs.texts and torch.equal(ours.completion_ids, theirs.completion_ids)
    assert ours.texts == hf_greedy(policy, tokenizer, prompts, NEW_TOKENS).texts
    gap = (ours.sampling_logp - theirs.sampling_logp)[ours.completion_mask.bool()].abs()
    print(f"adapter vs merged push: mean |log-prob difference| {gap.mean():.2e}, max {gap.max():.2e}")
    assert gap.mean() < 1e-3 and gap.max() < 1e-2  # the tolerance of merged vs the trainer (test_vllm_sampler.py)
    with policy.disable_adapter():  # eval's base pass: no adapter named, the engine's own base weights
        base = adapter.generate(policy, tokenizer, prompts, 1, greedy=True)
        assert base.texts == hf_greedy(policy, tokenizer, prompts, NEW_TOKENS).texts and base.texts != ours.texts


@needs_vllm
@pytest.mark.slow
def test_a_changed_adapter_is_sampled_under_a_new_id_and_an_unchanged_one_is_not_pushed(smollm2, monkeypatch):
    from grpo_cli.rollout import encode_prompts
    from grpo_cli.rollout import vllm as module

    policy, tokenizer, prompts, _, adapter = smollm2
    set_adapter(policy, 1)
    first = hf_greedy(policy, tokenizer, prompts, NEW_TOKENS).texts
    adapter.sync(policy)
    version = adapter._lora.lora_int_id
    writes, real_write = [], module.write_adapter

    def write(policy, folder):
        writes.append(folder)
        return real_write(policy, folder)

    monkeypatch.setattr(module, "write_adapter", write)
    adapter.sync(policy)  # the same weights: nothing written, the same id
    assert writes == [] and adapter._lora.lora_int_id == version
    set_adapter(policy, 2)
    adapter.sync(policy)
    assert len(writes) == 1 and adapter._lora.lora_int_id == version + 1
    assert adapter.llm.llm_engine.list_loras() == {version + 1}  # the version before removed from the engine
    ours = adapter.generate(policy, tokenizer, prompts, 1, greedy=True)
    # had the engine kept the old version's weights, it would answer `first` again
    assert ours.texts == hf_greedy(policy, tokenizer, prompts, NEW_TOKENS).texts and ours.texts != first
    # multi-turn episodes (VLLMEngine) sample with the adapter too: the same greedy ids as one generate call
    engine = adapter.engine(policy, tokenizer, greedy=True, generator=None)
    ids, mask = encode_prompts(tokenizer, prompts)  # [B, P] left-padded, as generate encodes them
    rows = [row[keep.bool()].tolist() for row, keep in zip(ids, mask)]
    expected = [ids[:n].tolist() for ids, n in zip(ours.completion_ids, ours.completion_mask.sum(1).tolist())]
    assert engine.continue_batch(rows, NEW_TOKENS) == expected
