"""grpo_cli.kernels: the chunked token log-probs, entropies and fused LM head against the plain autograd ones."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_cli.kernels import head_logprobs, take_rows, token_entropy, token_logprobs


def close(x, expected, tol=1e-4):
    return torch.allclose(torch.as_tensor(x, dtype=torch.float64),
                          torch.as_tensor(expected, dtype=torch.float64), atol=tol, rtol=0)


# --------------------------------------------------------------------------- token log-probs


@pytest.mark.parametrize("chunk_size", [1, 4, 5, 7, 15, 1000])   # N·T = 15: 4 and 7 don't divide it
def test_token_logprobs_matches_log_softmax(chunk_size):
    g = torch.Generator().manual_seed(chunk_size)
    logits = torch.randn(3, 5, 11, generator=g, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 11, (3, 5), generator=g)
    w = torch.randn(3, 5, generator=g, dtype=torch.float64)

    fast = token_logprobs(logits, tokens, chunk_size=chunk_size)
    (fast * w).sum().backward()
    grad_fast, logits.grad = logits.grad, None

    slow = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    (slow * w).sum().backward()
    assert torch.allclose(fast, slow, atol=1e-12)
    assert torch.allclose(grad_fast, logits.grad, atol=1e-12)


def test_token_logprobs_sliced_and_low_precision_logits():
    # logits[:, 2:6] is a slice along T (not flattenable without a copy); bf16 in -> fp32 out
    g = torch.Generator().manual_seed(0)
    full = torch.randn(2, 8, 13, generator=g).to(torch.bfloat16).requires_grad_()
    tokens = torch.randint(0, 13, (2, 4), generator=g)
    fast = token_logprobs(full[:, 2:6], tokens, chunk_size=3)
    slow = torch.log_softmax(full[:, 2:6].float(), -1).gather(-1, tokens[..., None]).squeeze(-1)
    assert fast.dtype == torch.float32
    assert torch.allclose(fast, slow, atol=1e-6)
    fast.sum().backward()
    assert full.grad.dtype == torch.bfloat16
    assert (full.grad[:, :2] == 0).all() and (full.grad[:, 6:] == 0).all()
    # each row's gradient is onehot - softmax: sums to 0
    assert torch.allclose(full.grad[:, 2:6].float().sum(-1), torch.zeros(2, 4), atol=2e-2)


def test_token_logprobs_gradcheck():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 5, (2, 3), generator=g)
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, tokens, chunk_size=4), (logits,))


def test_token_logprobs_saves_no_full_vocab_tensor():
    # a naive log_softmax would save an [N, T, V] result for backward; ours saves only the logits
    # themselves (no copy) and [N, T] tensors
    logits = torch.randn(4, 6, 50, requires_grad=True)
    tokens = torch.randint(0, 50, (4, 6))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
        token_logprobs(logits, tokens, chunk_size=5)
    big = [x for x in saved if x.numel() >= logits.numel()]
    assert all(x.data_ptr() == logits.data_ptr() for x in big)
    assert sum(x.numel() for x in saved if x.data_ptr() != logits.data_ptr()) <= 2 * 4 * 6


def test_token_logprobs_errors():
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), chunk_size=0)
    with pytest.raises(ValueError, match="tokens"):
        token_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 3, dtype=torch.long))


@pytest.mark.parametrize("chunk_size", [1, 4, 100])
def test_token_entropy(chunk_size):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 5, 11, generator=g, dtype=torch.float64) * 3
    direct = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    assert torch.allclose(token_entropy(logits, chunk_size=chunk_size), direct, atol=1e-12)
    # uniform over 4 tokens: ln 4 = 1.38629
    assert close(token_entropy(torch.zeros(1, 1, 4)), [[math.log(4)]], tol=1e-6)


# --------------------------------------------------------------------------- the fused LM head


@pytest.mark.parametrize("keep_elements", [None, 0])   # the softmax kept for backward, or recomputed there
@pytest.mark.parametrize("chunk_size", [1, 4, 7, 1000])   # M = 10: 4 and 7 don't divide it
def test_head_logprobs_matches_log_softmax_of_the_head(chunk_size, keep_elements):
    g = torch.Generator().manual_seed(chunk_size)
    hidden = torch.randn(10, 6, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(13, 6, generator=g, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 13, (10,), generator=g)
    w = torch.randn(10, generator=g, dtype=torch.float64)

    logp, entropy = head_logprobs(hidden, weight, tokens, chunk_size=chunk_size, with_entropy=True,
                                  keep_elements=keep_elements)
    (logp * w).sum().backward()
    fast = hidden.grad, weight.grad
    hidden.grad = weight.grad = None

    full = torch.log_softmax(hidden @ weight.T, -1)  # [M, V]
    slow = full.gather(-1, tokens[:, None]).squeeze(-1)
    (slow * w).sum().backward()
    assert torch.allclose(logp, slow, atol=1e-12)
    assert torch.allclose(entropy, -(full.exp() * full).sum(-1), atol=1e-12)
    assert torch.allclose(fast[0], hidden.grad, atol=1e-12) and torch.allclose(fast[1], weight.grad, atol=1e-12)
    assert entropy.requires_grad  # the entropy bonus differentiates it
    assert head_logprobs(hidden, weight, tokens)[1] is None  # entropy only when asked


@pytest.mark.parametrize("chunk_size", [1, 3, 64])
def test_head_entropy_gradient_matches_autograd_of_the_softmax(chunk_size):
    # the loss the entropy bonus makes: Σ w·logp + Σ u·H; the fused backward adds -u·p·(log p + H) per chunk
    g = torch.Generator().manual_seed(10 + chunk_size)
    hidden = torch.randn(9, 5, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 5, generator=g, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 11, (9,), generator=g)
    w, u = torch.randn(9, generator=g, dtype=torch.float64), torch.randn(9, generator=g, dtype=torch.float64)
    logp, entropy = head_logprobs(hidden, weight, tokens, chunk_size=chunk_size, with_entropy=True)
    ((logp * w).sum() + (entropy * u).sum()).backward()
    fast = hidden.grad, weight.grad
    hidden.grad = weight.grad = None
    full = torch.log_softmax(hidden @ weight.T, -1)
    slow_logp, slow_entropy = full.gather(-1, tokens[:, None]).squeeze(-1), -(full.exp() * full).sum(-1)
    ((slow_logp * w).sum() + (slow_entropy * u).sum()).backward()
    assert torch.allclose(fast[0], hidden.grad, atol=1e-12) and torch.allclose(fast[1], weight.grad, atol=1e-12)
    # the entropy alone (no log-prob term) and gradcheck of both outputs
    hidden.grad = None
    head_logprobs(hidden, weight, tokens, chunk_size=chunk_size, with_entropy=True)[1].sum().backward()
    again = torch.log_softmax(hidden @ weight.T, -1)
    expected = torch.autograd.grad(-(again.exp() * again).sum(), hidden)[0]
    assert torch.allclose(hidden.grad, expected, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda h, v: head_logprobs(h, v, tokens, chunk_size=chunk_size, with_entropy=True),
        (hidden.detach().requires_grad_(), weight.detach().requires_grad_()))


def test_head_logprobs_gradcheck_and_frozen_head():
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, 4, generator=g, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 7, (5,), generator=g)
    assert torch.autograd.gradcheck(lambda h, w: head_logprobs(h, w, tokens, chunk_size=2)[0], (hidden, weight))
    frozen = weight.detach()  # the LM head of a LoRA policy: no weight gradient is made
    head_logprobs(hidden, frozen, tokens, chunk_size=2)[0].sum().backward()
    assert hidden.grad is not None and frozen.grad is None


def test_head_logprobs_keeps_the_softmax_within_its_limit_and_never_the_logits():
    # M = 12 positions, V = 200: within the limit forward keeps the [M, V] softmax for backward (rows sum to 1),
    # over it (or with no gradient to come) nothing larger than the head itself; the logits are never kept
    hidden = torch.randn(12, 8, requires_grad=True)
    weight = torch.randn(200, 8)
    tokens = torch.randint(0, 200, (12,))

    def saved_by(**kw):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
            head_logprobs(hidden, weight, tokens, chunk_size=5, **kw)
        return [x for x in saved if x.numel() > weight.numel()]

    kept = saved_by()
    assert len(kept) == 1 and kept[0].shape == (12, 200)
    assert torch.allclose(kept[0].sum(-1), torch.ones(12)) and torch.allclose(
        kept[0], torch.softmax(hidden.detach() @ weight.T, -1), atol=1e-6)
    assert saved_by(keep_elements=12 * 200 - 1) == []  # one element over: recomputed in backward
    assert saved_by(keep_elements=0) == []
    with torch.no_grad():  # the reference forward: nothing kept
        assert saved_by() == []


def test_head_logprobs_low_precision_and_errors():
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(6, 8, generator=g).to(torch.bfloat16).requires_grad_()
    weight = torch.randn(11, 8, generator=g).to(torch.bfloat16)
    tokens = torch.randint(0, 11, (6,), generator=g)
    logp, _ = head_logprobs(hidden, weight, tokens, chunk_size=4)
    assert logp.dtype == torch.float32  # bf16 in, fp32 log-probs out
    slow = torch.log_softmax((hidden @ weight.T).float(), -1).gather(-1, tokens[:, None]).squeeze(-1)
    assert torch.allclose(logp, slow, atol=1e-5)
    logp.sum().backward()
    assert hidden.grad.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="chunk_size"):
        head_logprobs(hidden, weight, tokens, chunk_size=0)
    with pytest.raises(ValueError, match=r"\[M, D\]"):
        head_logprobs(hidden[None], weight, tokens)


def test_take_rows_backward_adds_the_same_way_every_time():
    # the KV cache of 4 prompts, each row taken by its 8 completions: [4, 9, 90, 64] -> [32, 9, 90, 64]. At this
    # size (>= torch's grain, 32768 elements) on 2 threads, t[index]'s backward gave 175 distinct gradients in 200
    # repeats; take_rows' must give one
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        generator = torch.Generator().manual_seed(0)
        cache = torch.randn(4, 9, 90, 64, generator=generator, requires_grad=True)
        index = torch.arange(4).repeat_interleave(8)[torch.randperm(32, generator=generator)]
        upstream = torch.randn(32, 9, 90, 64, generator=generator)
        assert torch.equal(take_rows(cache, index), cache[index])
        grads = []
        for _ in range(40):
            cache.grad = None
            take_rows(cache, index).backward(upstream)
            grads.append(cache.grad.clone())
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(g, grads[0]) for g in grads)
    # and it is the sum of each row's 8 gradients
    expected = torch.zeros_like(cache).index_add_(0, index, upstream)
    assert torch.allclose(grads[0], expected, atol=1e-5)
