"""The trainer's forward kernels (`logprobs`): token log-probs, entropies, the fused head, the row gather.

    logp = token_logprobs(logits, tokens)            # [N, T, V], [N, T] -> [N, T]
    entropy = token_entropy(logits)                  # [N, T, V] -> [N, T]
    logp, entropy = head_logprobs(hidden, weight, tokens, with_entropy=True)   # [M, D], [V, D], [M] -> [M], [M]
    kv = take_rows(cache, index)                     # [U, ...], [b] -> [b, ...], a backward that sums in order

The log-prob and entropy kernels work `chunk_size` positions at a time, so no full-vocabulary tensor of the
whole batch exists in forward or backward: a 150k vocabulary makes [N, T, V] fp32 values tens of GB. They
compute in fp32 at least (bf16 log-probs are off by ~1e-2, a ratio error of ~1%). Numerically they are
log_softmax(x)[tok] and -Σ softmax(x)·log softmax(x); what is written by hand is only the memory schedule of
forward and backward, which autograd alone would not keep to one chunk.
"""

from __future__ import annotations

import torch


def take_rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t[index] along dim 0 ([U, ...], [b] -> [b, ...]), where index repeats rows (the G completions of one
    prompt), with a backward that adds the repeated rows' gradients in the same order on every run.

    On a CPU, t[index]'s backward (index_put_ with accumulate) adds floats from several threads with atomics once
    the tensor is large (SmolLM2's KV cache is): 175 of 200 repeats gave distinct gradients on 2 threads, so two
    runs of one config drifted apart at a few parts in a million from their third step and a resume was not
    bitwise the run it continued. index_select's backward (index_add_) adds row by row in index order there. On
    CUDA it is the other way round by PyTorch's docs (index_add_ adds with atomics; indexing's accumulate sorts the
    indices first), so indexing stays there; not measured on a GPU.
    """
    if t.device.type == "cpu":
        return t.index_select(0, index)
    return t[index]


def _blocks(n: int, t: int, chunk_size: int):
    """(n0, n1, t0, t1) slabs of at most chunk_size positions of an [n, t] grid, in row-major order.

    Whole sequences together when a sequence fits in a chunk, else pieces of one sequence, so
    logits[n0:n1, t0:t1] is a cheap slab even when logits is a slice along T (not flattenable).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size ({chunk_size}) must be >= 1")
    if t == 0:
        return []
    if t <= chunk_size:
        k = chunk_size // t
        return [(a, min(a + k, n), 0, t) for a in range(0, n, k)]
    return [(a, a + 1, b, min(b + chunk_size, t)) for a in range(n) for b in range(0, t, chunk_size)]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # fp32 at least: bf16 log-probs are off by ~1e-2, which is a ratio error of ~1%
    return torch.promote_types(dtype, torch.float32)


class _TokenLogprobs(torch.autograd.Function):
    """log_softmax(logits)[tokens] chunk by chunk; backward rebuilds each chunk's softmax.

    Saves only the logits (held by the caller anyway), the tokens and the [N, T] logsumexp, so
    neither pass holds more than one chunk of full-vocabulary fp32 values.
    """

    @staticmethod
    def forward(ctx, logits, tokens, chunk_size):
        n, t, _ = logits.shape
        cd = _compute_dtype(logits.dtype)
        out = logits.new_empty((n, t), dtype=cd)         # [N, T]
        lse = logits.new_empty((n, t), dtype=cd)         # [N, T]
        blocks = _blocks(n, t, chunk_size)
        for n0, n1, t0, t1 in blocks:
            x = logits[n0:n1, t0:t1].to(cd)              # [n1-n0, t1-t0, V]; one chunk
            s = torch.logsumexp(x, -1)
            lse[n0:n1, t0:t1] = s
            out[n0:n1, t0:t1] = x.gather(-1, tokens[n0:n1, t0:t1, None]).squeeze(-1) - s
        ctx.save_for_backward(logits, tokens, lse)
        ctx.blocks = blocks
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        logits, tokens, lse = ctx.saved_tensors
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)   # [N, T, V]
        for n0, n1, t0, t1 in ctx.blocks:
            g = grad_out[n0:n1, t0:t1, None]             # [n, t, 1]
            # d/dx (x[tok] - lse) = onehot(tok) - softmax(x)
            p = logits[n0:n1, t0:t1] - lse[n0:n1, t0:t1, None]   # promoted to fp32: one chunk
            p.exp_().mul_(-g).scatter_add_(-1, tokens[n0:n1, t0:t1, None], g)
            grad[n0:n1, t0:t1] = p
        return grad, None, None


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, *, chunk_size: int = 1024) -> torch.Tensor:
    """log softmax(logits)[tokens]: [N, T, V] logits, [N, T] token ids -> [N, T] log-probs.

    Computed `chunk_size` positions at a time, so at most one chunk of fp32 [chunk, V] values is
    alive in forward and backward (a full log_softmax of 64 x 1024 positions of a 150k vocabulary
    would be 40 GB). Differentiable w.r.t. logits. The result is fp32 (fp64 for fp64 logits).
    Token ids must lie in [0, V) everywhere, pad positions included (mask them later, don't use -100).
    """
    if logits.dim() != 3 or tokens.shape != logits.shape[:2]:
        raise ValueError(f"logits must be [N, T, V] and tokens [N, T], "
                         f"got {tuple(logits.shape)} and {tuple(tokens.shape)}")
    _blocks(1, 1, chunk_size)                            # validates chunk_size
    return _TokenLogprobs.apply(logits, tokens.long(), chunk_size)


def token_entropy(logits: torch.Tensor, *, chunk_size: int = 1024) -> torch.Tensor:
    """Entropy of the next-token distribution at each position: [N, T, V] -> [N, T].

    H = logsumexp(x) - Σ softmax(x)·x, chunk by chunk like `token_logprobs`. In the caller's grad mode:
    differentiable (the entropy bonus) when grad is on and the logits require it; autograd then keeps
    each chunk's softmax, so call it under no_grad when the entropy is only logged.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [N, T, V], got {tuple(logits.shape)}")
    n, t, _ = logits.shape
    cd = _compute_dtype(logits.dtype)
    out = logits.new_empty((n, t), dtype=cd)
    for n0, n1, t0, t1 in _blocks(n, t, chunk_size):
        x = logits[n0:n1, t0:t1].to(cd)
        s = torch.logsumexp(x, -1, keepdim=True)
        out[n0:n1, t0:t1] = s.squeeze(-1) - (torch.exp(x - s) * x).sum(-1)
    return out


# the softmax the fused head keeps from forward for backward, in elements (fp32: 512 MB); above it backward
# recomputes the logits (one more head matmul per chunk)
KEEP_PROBS_ELEMENTS = 2**27


class _HeadLogprobs(torch.autograd.Function):
    """log_softmax(hidden @ weightᵀ)[tokens], the LM head and the log-softmax fused, chunk by chunk.

    Forward makes one chunk of [chunk, V] logits at a time and drops it, so the [M, V] logits never exist
    (SmolLM2, 32 x 64 positions: 400 MB of fp32 logits, and as much again for their gradient). What backward
    needs of them is the softmax p: when a gradient will be asked for and [M, V] fits `keep_elements`
    (a length bucket: 1024 positions x SmolLM2's 49,152 = 200 MB), forward keeps p, and backward is
    p·(-g) + onehot·g and one matmul per chunk; otherwise backward recomputes each chunk's logits from the
    saved hidden states (one more head matmul, and the exp, per chunk). Each chunk is exponentiated once:
    y = x - max, e = exp(y), lse = max + log Σe, H = log Σe - Σ e·y / Σe (the same H = lse - Σ p·x).

    The entropies are differentiable too (the entropy bonus, `entropy_coef`): with H = lse - Σ p·x,
    dH/dx_j = -p_j (log p_j + H), added to the log-prob's onehot(tok) - p in the same chunk (from recomputed
    logits: log p of a kept p can underflow).
    """

    @staticmethod
    def forward(ctx, hidden, weight, tokens, chunk_size, with_entropy, keep_elements):
        m = hidden.shape[0]
        cd = _compute_dtype(weight.dtype)
        out = hidden.new_empty(m, dtype=cd)              # [M] log-probs
        lse = hidden.new_empty(m, dtype=cd)              # [M] logsumexp, for backward
        entropy = hidden.new_empty(m if with_entropy else 0, dtype=cd)
        keep = (hidden.requires_grad or weight.requires_grad) and m * weight.shape[0] <= keep_elements
        probs = hidden.new_empty((m, weight.shape[0]) if keep else (0,), dtype=cd)  # [M, V] softmax, kept
        for a in range(0, m, chunk_size):
            b = min(a + chunk_size, m)
            y = (hidden[a:b].to(weight.dtype) @ weight.T).to(cd)   # [c, V]: one chunk of logits
            picked = y.gather(-1, tokens[a:b, None]).squeeze(-1)    # [c] the tokens' logits
            top = y.amax(-1, keepdim=True)                          # [c, 1]
            y.sub_(top)                                             # y = x - max, in place
            if keep:
                e = torch.exp(y, out=probs[a:b])
            else:
                e = y.exp() if with_entropy else y.exp_()           # y is needed for H only
            total = e.sum(-1)                                       # [c] Σ exp(x - max)
            s = top.squeeze(-1) + total.log()
            lse[a:b] = s
            out[a:b] = picked - s
            if with_entropy:  # H = log Σe - Σ e·y / Σe, the dot product without a [c, V] temporary
                entropy[a:b] = total.log() - torch.bmm(e[:, None, :], y[:, :, None]).view(-1) / total
            if keep:
                e.div_(total[:, None])                              # p, for backward
        ctx.save_for_backward(hidden, weight, tokens, lse, entropy, probs)
        ctx.chunk_size, ctx.kept = chunk_size, keep
        ctx.set_materialize_grads(False)  # an output the loss does not use (the entropy, mostly) gets None
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return out, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_entropy):
        hidden, weight, tokens, lse, entropy, probs = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None     # [M, D]
        grad_weight = (torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device)
                       if ctx.needs_input_grad[1] else None)                           # [V, D]
        if grad_out is None:
            grad_out = lse.new_zeros(lse.shape)
        for a in range(0, hidden.shape[0], ctx.chunk_size):
            b = min(a + ctx.chunk_size, hidden.shape[0])
            g = grad_out[a:b, None].to(lse.dtype)                                      # [c, 1]
            h = hidden[a:b].to(weight.dtype)
            # d/dx (x[tok] - lse) = onehot(tok) - softmax(x): [c, V]
            if grad_entropy is None and ctx.kept:  # the kept softmax (not in place: backward may run again)
                d = probs[a:b] * -g
            elif grad_entropy is None:  # x recomputed for this chunk
                d = (h @ weight.T).to(lse.dtype).sub_(lse[a:b, None]).exp_().mul_(-g)
            else:  # + g_H · dH/dx = -g_H · p · (log p + H), log p = x - lse
                log_p = (h @ weight.T).to(lse.dtype).sub_(lse[a:b, None])          # [c, V]
                g_h = grad_entropy[a:b, None].to(lse.dtype)                           # [c, 1]
                d = log_p.exp() * (-g - g_h * (log_p + entropy[a:b, None]))
            d.scatter_add_(-1, tokens[a:b, None], g)
            if grad_hidden is not None:
                grad_hidden[a:b] = (d.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += d.T @ h.to(lse.dtype)
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None, None)


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, *, chunk_size: int = 512,
                  with_entropy: bool = False,
                  keep_elements: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(hidden @ weightᵀ)[tokens] without the [M, V] logits: ([M] log-probs, [M] entropies or None).

    `hidden` [M, D] are the final (normed) hidden states of M positions, `weight` [V, D] the LM head, `tokens`
    [M] the token each position predicts. Both outputs are differentiable w.r.t. hidden and weight (the
    entropy for the entropy bonus; an entropy the loss does not use costs nothing in backward). fp32 results
    whatever the input precision, as `token_logprobs`. `keep_elements`: the largest [M, V] softmax kept from
    forward for backward (None: KEEP_PROBS_ELEMENTS; 0: none, backward recomputes the logits).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or tokens.shape != hidden.shape[:1] \
            or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden must be [M, D], weight [V, D] and tokens [M], got {tuple(hidden.shape)}, "
                         f"{tuple(weight.shape)} and {tuple(tokens.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size ({chunk_size}) must be >= 1")
    keep = KEEP_PROBS_ELEMENTS if keep_elements is None else keep_elements
    logp, entropy = _HeadLogprobs.apply(hidden, weight, tokens.long(), chunk_size, with_entropy, keep)
    return logp, (entropy if with_entropy else None)
