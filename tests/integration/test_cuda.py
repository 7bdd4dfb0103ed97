"""The CUDA path (#12): bf16 autocast, the prefill's logits, step timers and peak memory, the allocator,
the attention kernel and loading onto the device, reward models' device and input length, eval's
generate batches.

Each behaviour has a test that runs on the CPU (CUDA calls replaced where they must be); the tests
marked `cuda` run the same paths on a GPU and skip without one. scripts/gpu_check.sh runs them
(`pytest -m cuda`) on a machine that has one.
"""

from __future__ import annotations

import json
import os
import sys
import types

import pytest
import torch

from grpo_cli import cli, recipe
from grpo_cli import policy as policy_module
from grpo_cli.commands import evaluate, train
from grpo_cli.commands import rm as rm_command
from grpo_cli.commands import train as train_command
from grpo_cli.config import compose, validate
from grpo_cli.errors import ConfigError
from grpo_cli.logprobs import buckets, full_sequence_logprobs
from grpo_cli.metrics import memory as grpo_memory
from grpo_cli.policy import (
    apply_lora,
    autocast,
    build_policy,
    char_tokenizer,
    load_pretrained,
    load_tiny_random,
    resolve_dtype,
)
from grpo_cli.rewards.models import SequenceClassifierReward, TokenClassifierPRM
from grpo_cli.rollout import render_prompts
from grpo_cli.rollout.hf import HFSampler
from tests.helpers.runs import metrics, sampler_settings, tiny_cfg

CONVERSATIONS = [[{"role": "user", "content": "What is 2+3?"}], [{"role": "user", "content": "Hi"}]]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ---- bf16: autocast, fp32 LoRA master weights, fp16 refused ----------------------------------------------

def test_auto_dtype_is_bf16_only_on_a_gpu_that_has_it_natively(monkeypatch):
    asked = []
    for native, expected in ((True, torch.bfloat16), (False, torch.float32)):
        def supported(including_emulation=True, native=native):
            asked.append(including_emulation)
            return native

        monkeypatch.setattr(torch.cuda, "is_bf16_supported", supported)
        assert resolve_dtype("auto", torch.device("cuda")) == expected
    assert asked == [False, False]  # bf16 emulated on a pre-Ampere GPU does not count: it would be slow
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32


def test_fp16_training_is_refused_with_the_fix():
    fix = r"model.dtype \('float16'\) cannot train: .* set model.dtype=bfloat16 .* or model.dtype=float32"
    with pytest.raises(ConfigError, match=fix):
        validate(compose("train", ["model=tiny", "model.dtype=float16"]), *train_command.CHECKS)
    with pytest.raises(ConfigError, match="cannot train"):  # grpo rm trains a reward model on the same base
        validate(compose("rm", ["model=tiny", "model.dtype=fp16"]), *rm_command.CHECKS)
    validate(compose("eval", ["model=tiny", "model.dtype=float16"]))  # running a model in fp16 is fine
    validate(compose("train", ["model=tiny", "model.dtype=bfloat16"]), *train_command.CHECKS)


def _lora_inputs(policy) -> tuple[list, list]:
    """(seen, hooks): every LoRA A projection's (input dtype, autocast on) is appended to `seen`."""
    seen = []
    device = policy.get_input_embeddings().weight.device.type

    def record(module, args):
        seen.append((args[0].dtype, torch.is_autocast_enabled(device)))

    hooks = [m.register_forward_pre_hook(record) for name, m in policy.named_modules()
             if name.endswith("lora_A.default")]
    return seen, hooks


def _bf16_forwards(policy, tokenizer):
    """Sample and score with a bf16 policy; check each forward autocasts with bf16 LoRA inputs."""
    lora = {n: p for n, p in policy.named_parameters() if "lora_" in n}
    assert lora and all(p.dtype == torch.float32 for p in lora.values())  # fp32 master weights (peft's default)
    assert policy.get_input_embeddings().weight.dtype == torch.bfloat16
    seen, hooks = _lora_inputs(policy)
    try:
        torch.manual_seed(0)
        sampler = HFSampler(**sampler_settings(max_new_tokens=4))
        rollout = sampler.generate(policy, tokenizer, render_prompts(tokenizer, CONVERSATIONS), 2)
        # generation (prefill and every new token) ran under autocast, and peft did not copy the input to fp32
        assert seen and set(seen) == {(torch.bfloat16, True)}
        seen.clear()
        policy.train()
        parts = []
        for bucket in buckets(policy, rollout, grad=True):  # as the update runs them: a backward per bucket
            assert bucket.logp.dtype == torch.float32  # the log-softmax runs in fp32, outside autocast
            (bucket.logp * rollout.completion_mask[bucket.rows]).sum().backward()
            parts.append(bucket.logp.detach())
        assert set(seen) == {(torch.bfloat16, True)}
    finally:
        for hook in hooks:
            hook.remove()
    assert torch.cat(parts).isfinite().all()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in lora.values())
    assert [n for n, p in lora.items() if not p.grad.isfinite().all()] == []  # one NaN skips the optimizer step
    # B starts at zero, so A's gradient is zero at the start; B's is not
    assert any(p.grad.abs().sum() > 0 for n, p in lora.items() if "lora_B" in n)
    return rollout, {n: p.grad.clone() for n, p in lora.items()}


def test_bf16_forwards_autocast_with_fp32_lora_weights_and_no_fp32_input_copies():
    model, tokenizer = load_tiny_random(dtype=torch.bfloat16)
    policy = apply_lora(model, 4, 8, 0.0, ["q_proj", "v_proj"])
    rollout, shared = _bf16_forwards(policy, tokenizer)

    def grads(path):
        policy.zero_grad()
        if path == "full":
            full_sequence_logprobs(policy, rollout).logp.sum().backward()
        else:  # the trainer's buckets, a backward each
            for bucket in buckets(policy, rollout, grad=True):
                bucket.logp.sum().backward()
        return {n: p.grad.clone() for n, p in policy.named_parameters() if n in shared}

    # gradient checkpointing takes the whole-sequence path (its layers drop a KV cache) and recomputes the
    # forward in backward, outside the autocast block: the same gradients as that path without checkpointing
    plain = grads("full")
    policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed = grads("buckets")
    for name in shared:
        assert torch.allclose(checkpointed[name], plain[name], rtol=1e-2, atol=1e-6), name
        # the shared-prefix path adds in another order: equal up to bf16 rounding of the largest entries
        assert (shared[name] - plain[name]).abs().max() <= 3e-2 * plain[name].abs().max(), name


def test_fp32_forwards_are_left_alone():
    model, tokenizer = load_tiny_random()
    policy = apply_lora(model, 4, 8, 0.0, ["q_proj", "v_proj"])
    seen, hooks = _lora_inputs(policy)
    with autocast(policy):
        assert not torch.is_autocast_enabled("cpu")
    sampler = HFSampler(**sampler_settings(max_new_tokens=3))
    sampler.generate(policy, tokenizer, render_prompts(tokenizer, CONVERSATIONS), 2)
    for hook in hooks:
        hook.remove()
    assert set(seen) == {(torch.float32, False)}


# ---- the prompt prefill keeps one position's logits -------------------------------------------------------

def test_generation_never_computes_logits_for_the_whole_prompt(tiny):
    """Our prefill of each prompt and HF generate's own steps (transformers 5 passes logits_to_keep=1)
    send one position per row through the LM head, never the prompt's [B, P, V]."""
    model, tokenizer = tiny
    widths = []
    hook = model.get_output_embeddings().register_forward_pre_hook(lambda m, args: widths.append(args[0].shape[1]))
    try:
        sampler = HFSampler(**sampler_settings(max_new_tokens=5))
        sampler.generate(model, tokenizer, render_prompts(tokenizer, CONVERSATIONS), 3)
    finally:
        hook.remove()
    assert len(widths) >= 2 and set(widths) == {1}  # the prefill, then one call per generated token


# ---- step timers, peak memory, the allocator --------------------------------------------------------------

def test_timers_and_memory_helpers_act_on_cuda_only(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("synchronize", device)))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append(("reset", device)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 5 * 2**29)
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    grpo_memory.synchronize(cpu)
    grpo_memory.reset_peak_memory(cpu)
    assert calls == [] and grpo_memory.step_memory(cpu) == {}
    grpo_memory.synchronize(gpu)
    grpo_memory.reset_peak_memory(gpu)
    assert calls == [("synchronize", gpu), ("reset", gpu)]
    assert grpo_memory.step_memory(gpu) == {"memory/peak_allocated_gb": 3.0, "memory/peak_reserved_gb": 2.5}


def test_a_steps_record_carries_the_devices_peak_memory(tmp_path, monkeypatch):
    """What the memory probe reads for the step's device reaches metrics.jsonl (on CUDA: torch.cuda's peaks,
    test_timers_and_memory_helpers_act_on_cuda_only)."""
    monkeypatch.setattr(recipe, "step_memory", lambda device: {"memory/peak_allocated_gb": 1.5,
                                                               "memory/peak_reserved_gb": 2.0})
    train.run(tiny_cfg("trainer.max_steps=1"), tmp_path)
    [record] = metrics(tmp_path)
    assert record["memory/peak_allocated_gb"] == 1.5 and record["memory/peak_reserved_gb"] == 2.0
    assert 0 < record["time/rollout_s"] + record["time/update_s"] <= record["time/step_s"]


def test_allocator_conf_is_set_for_the_installed_torch_unless_the_user_set_it(monkeypatch):
    import importlib.metadata

    for installed, name in (("2.13.0+cpu", "PYTORCH_ALLOC_CONF"), ("2.8.0", "PYTORCH_CUDA_ALLOC_CONF")):
        monkeypatch.setattr(importlib.metadata, "version", lambda package, v=installed: v)
        env = {}
        cli.default_allocator_conf(env)
        assert env == {name: "expandable_segments:True"}
    for users in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        env = {users: "max_split_size_mb:128"}
        cli.default_allocator_conf(env)
        assert env == {users: "max_split_size_mb:128"}


def test_the_cli_sets_the_allocator_conf_before_it_imports_a_command(monkeypatch):
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if "ALLOC_CONF" not in k})
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    seen = {}
    command = types.SimpleNamespace(main=lambda: None)

    def import_module(name):
        seen["conf"] = {k: v for k, v in os.environ.items() if "ALLOC_CONF" in k}  # when torch would load
        return command

    import importlib

    monkeypatch.setattr(importlib, "import_module", import_module)
    cli.main(["train"])
    assert list(seen["conf"].values()) == ["expandable_segments:True"]


# ---- attention kernel, loading onto the device ------------------------------------------------------------

def test_attn_implementation_is_validated_and_honoured(monkeypatch):
    assert compose("train").model.attn_implementation == "sdpa"
    assert compose("train", ["model=hf", "model.name_or_path=x"]).model.attn_implementation == "sdpa"
    for kernel in ("eager", "sdpa"):
        policy, _, _ = build_policy(compose("train", ["model=tiny", f"model.attn_implementation={kernel}"]).model)
        assert policy.config._attn_implementation == kernel
    with pytest.raises(ConfigError, match=r"model.attn_implementation \('flash'\) must be one of sdpa, "
                                          r"flash_attention_2, eager, or null"):
        validate(compose("train", ["model=tiny", "model.attn_implementation=flash"]))
    flash = compose("train", ["model=tiny", "model.attn_implementation=flash_attention_2"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="needs a CUDA GPU and the flash-attn package.*attn_implementation=sdpa"):
        validate(flash.copy())
    import importlib.util

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "flash_attn" else None)
    assert policy_module._flash_attn()


def test_pretrained_weights_load_straight_onto_the_gpu(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    model, tokenizer = load_tiny_random()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    asked = {}
    real = AutoModelForCausalLM.from_pretrained

    def spy(name, **kwargs):
        asked.clear()
        asked.update(kwargs)
        kwargs.pop("device_map", None)  # no GPU here: load on the CPU after recording what was asked
        return real(name, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    load_pretrained(str(tmp_path), device=torch.device("cuda"), attn_implementation="eager")
    assert asked["device_map"] == torch.device("cuda") and asked["attn_implementation"] == "eager"
    load_pretrained(str(tmp_path), device=torch.device("cpu"))
    assert "device_map" not in asked and "attn_implementation" not in asked  # the CPU path as it always was


# ---- reward models: the policy's device, inputs cut to what the model reads --------------------------------

def test_reward_models_run_on_the_policys_device_by_default():
    for reward in ("orm", "prm"):
        tiny = compose("train", ["model=tiny", f"reward={reward}", "reward.name_or_path=x"])
        assert tiny.reward.device == tiny.model.device == "cpu"
        assert compose("eval", [f"reward={reward}", "reward.name_or_path=x"]).reward.device == "auto"
        assert compose("train", ["model=tiny", f"reward={reward}", "reward.name_or_path=x",
                                 "reward.device=cuda:1"]).reward.device == "cuda:1"


def _classifier(kind: str, positions: int):
    from transformers import LlamaConfig, LlamaForSequenceClassification, LlamaForTokenClassification

    tokenizer = char_tokenizer()  # one token per character, no special tokens added
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=positions, num_labels=1,
                      pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    cls = LlamaForSequenceClassification if kind == "orm" else LlamaForTokenClassification
    model = cls(cfg).eval()
    widths = []
    model.register_forward_pre_hook(lambda m, args, kwargs: widths.append(kwargs["input_ids"].shape[1]),
                                    with_kwargs=True)
    return model, tokenizer, widths


def test_orm_inputs_keep_their_last_tokens_up_to_the_models_length():
    model, tokenizer, widths = _classifier("orm", 24)
    orm = SequenceClassifierReward(model=model, tokenizer=tokenizer, device="cpu")
    completion = "first 1 + 1 = 2, then 2 + 2 = 4, so the answer is 4"
    [long] = orm(["Q: "], [completion])
    assert widths == [24]  # 3 + 52 characters, cut to the 24 positions the model has
    [tail] = orm([""], [("Q: " + completion)[-24:]])  # the head reads the last token: the end is what stays
    assert long == pytest.approx(tail)
    assert tokenizer.truncation_side == "right"  # the tokenizer is left as it was


def test_prm_inputs_keep_their_first_tokens_and_steps_past_the_cut_get_no_reward():
    model, tokenizer, widths = _classifier("prm", 24)
    prm = TokenClassifierPRM(model=model, tokenizer=tokenizer, device="cpu")
    completion = "\n".join(["1+1=2"] * 10)  # step i's last character: 3 + 6i + 4 in the input
    [steps] = prm(["Q: "], [completion])
    assert widths == [24]
    # steps 0-2 end at characters 7, 13, 19 (inside the 24 kept); step 3 ends at 25, past the cut
    assert [end for end, _ in steps] == [5, 11, 17]


# ---- eval's generate calls, counted in sequences ----------------------------------------------------------

def test_eval_generate_calls_hold_at_most_sampler_batch_size_sequences(tmp_path, monkeypatch):
    calls = []
    real = HFSampler._generate

    def counting(self, model, tokenizer, prompts, n, **options):
        calls.append(len(prompts) * n)
        return real(self, model, tokenizer, prompts, n, **options)

    monkeypatch.setattr(HFSampler, "_generate", counting)
    cfg = compose("eval", ["model=tiny", "sampler.max_new_tokens=3", "data.heldout_size=20", "eval.limit=3",
                           "eval.num_samples=4", "eval.k=[1]", "eval.batch_size=3", "sampler.batch_size=5"])
    evaluate.run(cfg, tmp_path, [])
    # one scoring batch of 3 problems: greedy 3 x 1 in one call (3 <= 5); 3 x 4 samples at 5 // 4 = 1 problem a call
    assert calls == [3, 4, 4, 4]
    assert len((tmp_path / "eval_samples.jsonl").read_text().splitlines()) == 3


# ---- left-padded prompts: finite gradients through the prompt pass ------------------------------------------

def _padded_prompt_gradients(device: str) -> list[str]:
    """The LoRA parameters whose gradient is not finite after one bf16 update pass over prompts of two lengths.

    The prompts are left-padded to one width, so in the shared prompt pass (grpo_cli.logprobs.buckets) each pad
    position is a query that may attend to no key. Width 128 over 2 heads: head_dim 64, as SmolLM2's (the tiny
    model's is 8). On an H200 (torch 2.11+cu130) a 576-wide, 30-layer random model over prompts left-padded to 64
    tokens had a NaN gradient norm at every step, and same-length prompts trained (policy.no_cudnn_attention)."""
    model, tokenizer = load_tiny_random(128, 2, 2, dtype=torch.bfloat16, device=torch.device(device))
    policy = apply_lora(model, 4, 8, 0.0, ["q_proj", "v_proj"])
    torch.manual_seed(0)
    sampler = HFSampler(**sampler_settings(max_new_tokens=4))
    # data=arithmetic's prompts (45 and 43 characters): the longer renders to 64 tokens, so the prompt pass's keys
    # are 64 long (the NaN of pytorch#196678 needs a length of 64 mod 128) and the shorter has 2 pad positions
    ask = "What is {}? Answer with just the number."
    conversations = [[{"role": "user", "content": ask.format(sum_)}] for sum_ in ("37 + 52", "5 + 2")]
    rollout = sampler.generate(policy, tokenizer, render_prompts(tokenizer, conversations), 2)
    assert rollout.prompt_ids.shape[1] == 64 and (rollout.prompt_mask == 0).sum() == 2 * 2  # 2 samples each
    policy.train()
    for bucket in buckets(policy, rollout, grad=True):
        (bucket.logp * rollout.completion_mask[bucket.rows]).sum().backward()
    return [n for n, p in policy.named_parameters() if p.grad is not None and not p.grad.isfinite().all()]


def test_left_padded_prompts_give_finite_gradients():
    assert _padded_prompt_gradients("cpu") == []


def test_forwards_with_a_gradient_do_not_pick_cudnn_attention():
    # cuDNN's attention backward returns NaN for such prompts on Hopper (policy.no_cudnn_attention); the setting is
    # read by sdpa as each forward runs, and comes back afterwards
    model, tokenizer = load_tiny_random(dtype=torch.bfloat16)
    policy = apply_lora(model, 4, 8, 0.0, ["q_proj", "v_proj"])
    seen = []
    hook = policy.get_base_model().model.layers[0].register_forward_pre_hook(
        lambda module, args: seen.append((torch.is_grad_enabled(), torch.backends.cuda.cudnn_sdp_enabled())))
    before = torch.backends.cuda.cudnn_sdp_enabled()
    rollout = HFSampler(**sampler_settings(max_new_tokens=3)).generate(
        policy, tokenizer, render_prompts(tokenizer, CONVERSATIONS), 2)
    for bucket in buckets(policy, rollout, grad=True):
        bucket.logp.sum().backward()
    hook.remove()
    assert {on for grad, on in seen if grad} == {False}  # the update's prompt pass and buckets
    assert {on for grad, on in seen if not grad} == {before}  # generation: as the process set it
    assert torch.backends.cuda.cudnn_sdp_enabled() == before


# ---- on a GPU (pytest -m cuda; skipped without one) -------------------------------------------------------

@pytest.mark.cuda
@needs_cuda
def test_cuda_left_padded_prompts_give_finite_gradients():
    assert _padded_prompt_gradients("cuda") == []


@pytest.mark.cuda
@needs_cuda
def test_cuda_bf16_policy_autocasts():
    cfg = compose("train", ["model=tiny", "model.device=cuda", "model.dtype=auto"]).model
    policy, tokenizer, device = build_policy(cfg)
    assert device.type == "cuda" and next(policy.parameters()).device.type == "cuda"
    _bf16_forwards(policy, tokenizer)  # bf16 on any GPU this project targets (Ampere on)


@pytest.mark.cuda
@needs_cuda
def test_cuda_attn_implementation_is_honoured():
    logits = {}
    ids = torch.arange(3, 40, device="cuda")[None]
    for kernel in ("eager", "sdpa"):
        cfg = compose("train", ["model=tiny", "model.device=cuda", "model.dtype=bfloat16",
                                f"model.attn_implementation={kernel}"]).model
        policy, _, _ = build_policy(cfg)
        assert policy.config._attn_implementation == kernel
        with torch.no_grad(), autocast(policy):
            logits[kernel] = policy(input_ids=ids).logits.float()
    assert torch.allclose(logits["eager"], logits["sdpa"], atol=5e-2)  # two kernels, one model (bf16 rounding)


@pytest.mark.cuda
@needs_cuda
def test_cuda_pretrained_loads_onto_the_gpu(tmp_path):
    model, tokenizer = load_tiny_random()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, _ = load_pretrained(str(tmp_path), dtype=torch.bfloat16, device=torch.device("cuda"))
    assert {p.device.type for p in loaded.parameters()} == {"cuda"}
    assert not hasattr(loaded, "_hf_hook")  # one device: no accelerate dispatch hooks


@pytest.mark.cuda
@needs_cuda
def test_cuda_train_steps_log_times_and_peak_memory(tmp_path):
    train.run(tiny_cfg("trainer.max_steps=2", "model.device=cuda", "model.dtype=bfloat16"), tmp_path)
    for record in metrics(tmp_path):
        assert 0 < record["memory/peak_allocated_gb"] <= record["memory/peak_reserved_gb"]
        assert record["time/rollout_s"] > 0 and record["time/update_s"] > 0
        assert all(isinstance(v, (int, float)) for k, v in record.items() if k.startswith("memory/"))
    print(json.dumps({k: v for k, v in metrics(tmp_path)[-1].items() if k.startswith(("time/", "memory/"))}))


@pytest.mark.cuda
@needs_cuda
def test_cuda_reward_model_scores_on_the_gpu():
    model, tokenizer, widths = _classifier("orm", 24)
    orm = SequenceClassifierReward(model=model.to("cuda"), tokenizer=tokenizer, device="cuda")
    scores = orm(["Q: ", "Q: "], ["a long completion that runs past the model's positions", "4"])
    assert len(scores) == 2 and all(0 < s < 1 for s in scores) and widths == [24]
