"""The trainer's forward: the log-probs (and entropies) of a rollout's completion tokens under the policy.

    for bucket in buckets(policy, rollout, with_entropy=True, grad=True):   # the update's loop
        loss = ...                    # of bucket.logp [b, T] for the rollout's rows bucket.rows [b]
        loss.backward()               # before the next bucket is asked for
    scored = sequence_logprobs(policy, rollout)   # no gradient: scored.logp [N, T] (reference, old policy)

It does the tokens' work, not the padded batch's:
  - each distinct prompt goes through the model once; its KV cache is shared by the rows that continue
    it (the G completions of a group), gradient included;
  - the completions go through in buckets of `bucket_rows` rows of similar length (sorted), each cut to
    its own longest completion, so short rows do not pay for the longest;
  - the LM head and the log-softmax are fused in chunks (`kernels.head_logprobs`): the [N, T, V]
    logits are never made, in forward or backward.

The caller back-propagates each bucket's loss before the next bucket runs, so the peak holds the prompts
and one bucket's activations, not the whole micro-batch's. The buckets read detached copies of the
prompts' caches, whose gradients gather there; once the buckets run out, the generator sends them
through the prompt pass in one backward. The loss must be a sum over rows (GRPO's is, `objective`) for
the bucket losses to add up to the micro-batch's.

Positions follow HF generate (left-padded prompt, position ids = cumsum of the mask - 1, as
`policy.position_ids`), so the tokens are scored exactly as the sampler produced them. Models whose
logits are not the LM head of the last hidden state, and gradient checkpointing in training (its layers
drop the KV cache they are given), take `full_sequence_logprobs` instead: one bucket of every row.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from grpo_cli.fsdp import root_gathered
from grpo_cli.kernels import head_logprobs, take_rows, token_entropy, token_logprobs
from grpo_cli.policy import autocast, position_ids
from grpo_cli.rollout import Rollout

# rows scored together by default: the most a length bucket holds (the update's may hold fewer, trainer.bucket_tokens)
BUCKET_ROWS = 8


@dataclass
class Bucket:
    """Rows of a rollout scored together."""

    rows: torch.Tensor  # [b] their positions in the rollout
    logp: torch.Tensor  # [b, T] log-probs of the completion tokens, 0 on padding; in the graph when grad=True
    # [b, T] entropies, 0 on padding; None unless asked for; in the graph with grad=True (whole-sequence path:
    # only with entropy_grad=True)
    entropy: torch.Tensor | None


@dataclass
class Logprobs:
    """A rollout's log-probs, rows in the rollout's order."""

    logp: torch.Tensor  # [N, T], 0 on padding
    entropy: torch.Tensor | None  # [N, T], 0 on padding; None unless asked for


def buckets(model, rollout: Rollout, *, with_entropy: bool = False, grad: bool = False,
            entropy_grad: bool = False, bucket_rows: int = BUCKET_ROWS, decoder=None) -> Iterator[Bucket]:
    """The rollout's rows in buckets of at most `bucket_rows` rows of similar length, each scored when asked for.

    grad=True: each bucket's `logp` carries the gradient; back-propagate its loss before asking for the next
    bucket. When the buckets run out, the gradients the prompts' caches gathered go through the prompt pass
    (a loop left early sends none). grad=False: no graph. `entropy_grad`: the loss differentiates the entropy
    (the entropy bonus); the fused head gives it a gradient anyway at no cost unless used, the whole-sequence
    path only when asked, since it then keeps each chunk's softmax. `decoder`: called in place of the model's
    decoder with the same arguments (the update's compiled one, `grpo_cli.compiled`); None: the decoder itself.
    """
    with root_gathered(model):  # a sharded base (trainer.fsdp): the embeddings and the head's weight read below
        yield from _buckets(model, rollout, with_entropy, grad, entropy_grad, bucket_rows, decoder)


def _buckets(model, rollout: Rollout, with_entropy: bool, grad: bool, entropy_grad: bool,
             bucket_rows: int, decoder) -> Iterator[Bucket]:
    body, head = _decoder_and_head(model)
    run_body = body if decoder is None else decoder
    # checkpointed layers in training drop a KV cache they are given (transformers' GradientCheckpointingLayer)
    checkpointing = body.training and any(getattr(m, "gradient_checkpointing", False) for m in body.modules())
    n, width = rollout.completion_ids.shape
    if head is None or checkpointing:
        with torch.set_grad_enabled(grad):
            whole = full_sequence_logprobs(model, rollout, with_entropy=with_entropy, entropy_grad=entropy_grad)
        yield Bucket(torch.arange(n, device=whole.logp.device), whole.logp, whole.entropy)
        return
    lengths = rollout.completion_mask.sum(1).clamp(min=1).tolist()  # [N] one host copy; EOS included
    order = sorted(range(n), key=lambda i: lengths[i])
    cache_key = "cache" if "cache" in inspect.signature(body.forward).parameters else "past_key_values"
    with torch.set_grad_enabled(grad), autocast(model):
        # [U, P] distinct prompts (ids and mask together: a pad id can also be a real token); which[i] = row i's
        prompts, which = torch.unique(torch.cat([rollout.prompt_ids, rollout.prompt_mask], 1), dim=0,
                                      return_inverse=True)
        p_ids, p_mask = prompts.split(rollout.prompt_ids.shape[1], 1)
        out = run_body(input_ids=p_ids, attention_mask=p_mask, position_ids=position_ids(p_mask), use_cache=True)
        cache = out["cache" if "cache" in out else "past_key_values"]  # named as in hf.py's prefill, by version
        # [U, H, P, d] keys and values per layer, and [U, D] the last hidden state (predicts each first token)
        inputs = [t for layer in cache.layers for t in (layer.keys, layer.values)] + [out.last_hidden_state[:, -1]]
    # the buckets read detached copies: their gradients gather in .grad and reach the prompt pass at the end
    prompt = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
    *kv, last = prompt
    for start in range(0, n, bucket_rows):
        members = order[start:start + bucket_rows]
        rows = torch.tensor(members, device=which.device)  # [b]
        own = which[rows]  # [b] each row's prompt
        t = max(lengths[i] for i in members)
        # the decoder runs once per bucket, even one of one-token rows (on that token, its output unused but in the
        # graph): under FSDP every rank then runs the same forwards and backwards (grpo_cli.fsdp)
        run = max(t - 1, 1)
        with torch.set_grad_enabled(grad), autocast(model):
            tokens = rollout.completion_ids[rows, :t]  # [b, t]
            # tokens 0..t-2 continue the shared prompt caches; their outputs predict tokens 1..t-1
            shared = DynamicCache(ddp_cache_data=[(take_rows(kv[i], own), take_rows(kv[i + 1], own))
                                                  for i in range(0, len(kv), 2)])
            mask = torch.cat([p_mask[own], rollout.completion_mask[rows, :run]], 1)  # [b, P+run]
            pos = p_mask[own].sum(1, keepdim=True) + torch.arange(run, device=mask.device)
            h = run_body(input_ids=rollout.completion_ids[rows, :run], attention_mask=mask, position_ids=pos,
                     use_cache=True, **{cache_key: shared}).last_hidden_state  # [b, run, D]
            hidden = torch.cat([take_rows(last, own)[:, None], h], 1)[:, :t]  # [b, t, D]
            logp, entropy = head_logprobs(hidden.flatten(0, 1), head.weight, tokens.flatten(),
                                          with_entropy=with_entropy)
            logp = torch.nn.functional.pad(logp.view(-1, t), (0, width - t)) * rollout.completion_mask[rows]  # [b, T]
            if with_entropy:
                entropy = torch.nn.functional.pad(entropy.view(-1, t), (0, width - t)) * rollout.completion_mask[rows]
        yield Bucket(rows, logp, entropy)
    if any(t.grad is not None for t in prompt):
        torch.autograd.backward([x for x, t in zip(inputs, prompt) if t.grad is not None],
                                [t.grad for t in prompt if t.grad is not None])


@torch.no_grad()
def sequence_logprobs(model, rollout: Rollout, *, with_entropy: bool = False,
                      bucket_rows: int = BUCKET_ROWS) -> Logprobs:
    """Every row's log-probs (and entropies), no gradient: the buckets, back in the rollout's row order."""
    parts = list(buckets(model, rollout, with_entropy=with_entropy, bucket_rows=bucket_rows))
    back = torch.argsort(torch.cat([b.rows for b in parts]))  # rows back from length order to the rollout's
    logp = torch.cat([b.logp for b in parts])[back]  # [N, T]
    return Logprobs(logp, torch.cat([b.entropy for b in parts])[back] if with_entropy else None)


def _decoder_and_head(model):
    """(decoder, LM head Linear) of a causal LM (peft-wrapped or not); head None when the logits are not
    just the head of the last hidden state (a LoRA on lm_head, softcapping, a logit scale)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    body, head = base.get_decoder(), base.get_output_embeddings()
    config = base.config
    plain = type(head) is torch.nn.Linear and head.bias is None and not any(
        getattr(config, key, None) not in (None, 1, 1.0)
        for key in ("final_logit_softcapping", "logit_scale", "logits_scaling"))
    return body, (head if plain else None)


def full_sequence_logprobs(model, rollout: Rollout, *, with_entropy: bool = False,
                           entropy_grad: bool = False) -> Logprobs:
    """The log-probs the plain way: every row's whole padded prompt + completion through the model, in the
    caller's grad mode (the entropies carry a gradient only with entropy_grad=True).

    Only the last T+1 positions go through the LM head (`logits_to_keep`); `token_logprobs` chunks the
    log-softmax over the vocabulary, in fp32 outside autocast (bf16 logits are upcast one chunk at a time).
    """
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)  # [N, P+T]
    mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], 1)
    T = rollout.completion_ids.shape[1]
    with autocast(model):
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=False,
                       logits_to_keep=T + 1).logits[:, :-1]  # [N, T, V]: position P-1+t predicts token t
    logp = token_logprobs(logits, rollout.completion_ids) * rollout.completion_mask  # [N, T]
    if not with_entropy:
        return Logprobs(logp, None)
    with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
        return Logprobs(logp, token_entropy(logits) * rollout.completion_mask)
