"""Rollouts: the `Rollout` record every sampler returns, the sampler contract, and the training-side
log-probs of a rollout.

A sampler (the `sampler` config group, one `_target_`) implements

    generate(policy, tokenizer, prompts, n, *, greedy=False, max_new_tokens=None, temperature=None) -> Rollout
    sync(policy) -> None     # engines that hold their own copy of the weights refresh it here

The trainer calls `sync` once per step before `generate` and never asks which engine it has.
Engines: `hf.HFSampler` (transformers `generate` with a shared prompt prefill) and `vllm.VLLMSampler`
(vLLM with its own copy of the weights, refreshed by `sync`; `sampler=vllm`).

Prompts are left-padded (every completion starts at the same column); position ids follow HF
generate (cumsum of the attention mask - 1), and `sequence_logprobs` uses the same ones, so the
training forward scores exactly the tokens the sampler produced. It does the tokens' work, not the
padded batch's: each distinct prompt once (its KV cache shared by its G completions, gradient
included), completions in length buckets, the LM head fused with the log-softmax.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import DynamicCache

from grpo_cli.errors import DataError
from grpo_cli.objective import head_logprobs, token_entropy, token_logprobs
from grpo_cli.policy import autocast


@dataclass
class Rollout:
    """N = B * G sequences; row i belongs to prompt i // G."""

    prompt_ids: torch.Tensor  # [N, P] left-padded
    prompt_mask: torch.Tensor  # [N, P] 1 on real prompt tokens
    completion_ids: torch.Tensor  # [N, T] right-padded with pad_token_id
    completion_mask: torch.Tensor  # [N, T] 1 up to and including the EOS token
    texts: list[str]  # N decoded completions, special tokens skipped
    truncated: list[bool]  # N: no EOS within max_new_tokens
    # [N, T] the engine's log-prob of each sampled token under the policy's plain softmax (temperature 1,
    # no top-p/top-k: what the trainer scores), 0 on pad; engines with their own copy of the weights
    # return it (vLLM); None for HF generate, which samples from the trainer's own policy
    sampling_logp: torch.Tensor | None = None

    @property
    def lengths(self) -> list[int]:
        return self.completion_mask.sum(1).tolist()

    @staticmethod
    def concat(parts: list[Rollout], pad: int) -> Rollout:
        """Rows of several rollouts in order: prompts re-padded on the left, completions on the right."""
        if len(parts) == 1:
            return parts[0]
        width_p = max(r.prompt_ids.shape[1] for r in parts)
        width_t = max(r.completion_ids.shape[1] for r in parts)

        def left(x, width, value):  # [n, w] -> [n, width], padding before the prompt
            return torch.nn.functional.pad(x, (width - x.shape[1], 0), value=value)

        def right(x, width, value):  # [n, w] -> [n, width], padding after the completion
            return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)

        logp = None
        if all(r.sampling_logp is not None for r in parts):
            logp = torch.cat([right(r.sampling_logp, width_t, 0.0) for r in parts])
        return Rollout(torch.cat([left(r.prompt_ids, width_p, pad) for r in parts]),
                       torch.cat([left(r.prompt_mask, width_p, 0) for r in parts]),
                       torch.cat([right(r.completion_ids, width_t, pad) for r in parts]),
                       torch.cat([right(r.completion_mask, width_t, 0) for r in parts]),
                       [t for r in parts for t in r.texts], [t for r in parts for t in r.truncated], logp)

    def select(self, rows: torch.Tensor | list[int]) -> Rollout:
        rows = torch.as_tensor(rows, dtype=torch.long)
        pick = rows.tolist()
        return Rollout(self.prompt_ids[rows], self.prompt_mask[rows], self.completion_ids[rows],
                       self.completion_mask[rows], [self.texts[i] for i in pick], [self.truncated[i] for i in pick],
                       None if self.sampling_logp is None else self.sampling_logp[rows])


class Sampler(Protocol):
    """What the trainer, eval and sample need from a rollout engine."""

    def generate(self, policy, tokenizer, prompts: list[str], n: int, *, greedy: bool = False,
                 max_new_tokens: int | None = None, temperature: float | None = None) -> Rollout: ...

    def sync(self, policy) -> None: ...


class ChatPrompt(str):
    """A chat-templated prompt that remembers which of its spans are message text.

    `parts` are (text, is_message_text) pairs that join to the string itself. `encode_prompts`
    tokenizes message text with special-token strings split into ordinary tokens, so "<|im_end|>"
    typed in a question stays text; only the template's own markup becomes control tokens.
    """

    parts: tuple[tuple[str, bool], ...]

    def __new__(cls, parts: list[tuple[str, bool]]) -> ChatPrompt:
        prompt = super().__new__(cls, "".join(text for text, _ in parts))
        prompt.parts = tuple(parts)
        return prompt


# stands in for message i while the template renders: private-use characters no template or tokenizer reads
_MARK = re.compile("\ue000(\\d+)\ue001")


def render_prompts(tokenizer, conversations: list[list[dict]]) -> list[str]:
    """Chat-template each conversation, ending with the assistant's turn opened.

    A conversation whose message text holds a special-token string comes back as a ChatPrompt; every
    other prompt is a plain string, tokenized exactly as before.
    """
    specials = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
    prompts = []
    for conversation in conversations:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        if any(s in str(m["content"]) for m in conversation for s in specials):
            text = _mark_messages(tokenizer, conversation, text)
        prompts.append(text)
    return prompts


def _mark_messages(tokenizer, conversation: list[dict], text: str) -> ChatPrompt:
    """`text` split into template markup and message text: the template rendered once more with a mark
    in place of each message's text shows where the messages go."""
    marked = [{**m, "content": f"\ue000{i}\ue001"} for i, m in enumerate(conversation)]
    skeleton = _MARK.split(tokenizer.apply_chat_template(marked, add_generation_prompt=True, tokenize=False))
    for shape in (str, str.strip):  # some templates strip message text (Llama 3's does)
        # split() alternates markup and the captured message index
        parts = [(shape(str(conversation[int(piece)]["content"])), True) if k % 2 else (piece, False)
                 for k, piece in enumerate(skeleton) if piece]
        if "".join(t for t, _ in parts) == text:
            return ChatPrompt(parts)
    raise DataError(f"a prompt holds a special token string ({text[:100]!r}...) and this tokenizer's chat "
                    f"template rewrites message text, so it cannot be kept as plain text; remove it from the data")


def encode_prompts(tokenizer, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, P] and attention mask [B, P] of chat-templated prompts, left-padded.

    The message text of a ChatPrompt is tokenized with special-token strings kept as text.
    """
    rows = []
    for prompt in prompts:
        ids: list[int] = []
        for text, is_message in getattr(prompt, "parts", None) or ((prompt, False),):
            ids += tokenizer(text, add_special_tokens=False, split_special_tokens=is_message).input_ids
        rows.append(ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row):] = 1
    return ids, mask


def finish(tokenizer, prompt_ids, prompt_mask, completion, eos: int, pad: int) -> Rollout:
    """A Rollout from raw completions: everything after the first EOS masked; no EOS = truncated."""
    is_eos = completion == eos
    has_eos = is_eos.any(1)
    first_eos = torch.where(has_eos, is_eos.int().argmax(1), completion.shape[1])  # [N]
    cols = torch.arange(completion.shape[1], device=completion.device)
    mask = (cols[None, :] <= first_eos[:, None]).long()  # [N, T], EOS itself included
    completion = completion.masked_fill(mask == 0, pad)
    # one copy to the host for decoding, not a device sync per row
    ids, keep = completion.cpu(), mask.cpu().bool()
    texts = tokenizer.batch_decode([row[m] for row, m in zip(ids, keep)], skip_special_tokens=True)
    return Rollout(prompt_ids, prompt_mask, completion, mask, texts, (~has_eos).tolist())


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as HF generate computes them. [N, L]"""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.masked_fill(attention_mask == 0, 0)


def sequence_logprobs(model, rollout: Rollout, *, with_entropy: bool = False, bucket_rows: int = 8,
                      backward=None):
    """Log-probs of the completion tokens under `model`: [N, T] (and entropies [N, T] if asked), 0 on padding.

    The work done is the tokens', not the padded batch's:
      - each distinct prompt goes through the model once; its KV cache is shared by the rows that
        continue it (the G completions of a group), gradient included;
      - the completions go through in buckets of `bucket_rows` rows of similar length (sorted), each
        cut to its own longest completion, so short rows do not pay for the longest;
      - the LM head and the log-softmax are fused in chunks (`objective.head_logprobs`): the [N, T, V]
        logits are never made, in forward or backward.
    Positions follow HF generate (left-padded prompt, position ids = cumsum of the mask - 1), so the
    tokens are scored exactly as the sampler produced them. Models whose logits are not the LM head of
    the last hidden state, and gradient checkpointing in training (its layers drop the KV cache), take
    `full_sequence_logprobs` instead.

    `backward(rows, logp, entropy) -> loss`: the loss of a bucket (rows: positions in `rollout`, logp and
    entropy [b, T]), back-propagated at once. Each bucket's activations are then freed before the next
    bucket runs, and the prompts' after the last (their gradients gathered from every bucket), so the
    peak holds the prompts and one bucket, not the whole batch. The log-probs come back detached.
    """
    body, head = _decoder_and_head(model)
    # checkpointed layers drop a KV cache they are given (transformers' GradientCheckpointingLayer)
    checkpointing = body.training and torch.is_grad_enabled() and any(
        getattr(m, "gradient_checkpointing", False) for m in body.modules())

    n, width = rollout.completion_ids.shape
    if head is None or checkpointing:
        out = full_sequence_logprobs(model, rollout, with_entropy=with_entropy)
        logp, entropy = out if with_entropy else (out, None)
        if backward is not None:
            backward(torch.arange(n, device=logp.device), logp, entropy).backward()
            return (logp.detach(), entropy) if with_entropy else logp.detach()
        return out
    lengths = rollout.completion_mask.sum(1).clamp(min=1).tolist()  # [N] one host copy; EOS included
    order = sorted(range(n), key=lambda i: lengths[i])
    cache_key = "cache" if "cache" in inspect.signature(body.forward).parameters else "past_key_values"
    with autocast(model):
        # [U, P] distinct prompts (ids and mask together: a pad id can also be a real token); which[i] = row i's
        prompts, which = torch.unique(torch.cat([rollout.prompt_ids, rollout.prompt_mask], 1), dim=0,
                                      return_inverse=True)
        p_ids, p_mask = prompts.split(rollout.prompt_ids.shape[1], 1)
        out = body(input_ids=p_ids, attention_mask=p_mask, position_ids=position_ids(p_mask), use_cache=True)
        cache = out["cache" if "cache" in out else "past_key_values"]  # named as in hf.py's prefill, by version
        # [U, H, P, d] keys and values per layer, and [U, D] the last hidden state (predicts each first token)
        prompt = [t for layer in cache.layers for t in (layer.keys, layer.values)] + [out.last_hidden_state[:, -1]]
        if backward is not None:  # buckets read detached copies; their gradients reach the prompt pass at the end
            inputs, prompt = prompt, [t.detach().requires_grad_(t.requires_grad) for t in prompt]
        *kv, last = prompt
        pieces, entropies = [], []
        for start in range(0, n, bucket_rows):
            rows = torch.tensor(order[start:start + bucket_rows], device=which.device)
            own = which[rows]  # [b] each row's prompt
            t = max(lengths[i] for i in order[start:start + bucket_rows])
            tokens = rollout.completion_ids[rows, :t]  # [b, t]
            hidden = last[own][:, None]  # [b, 1, D]
            if t > 1:  # tokens 0..t-2 continue the shared prompt caches; their outputs predict tokens 1..t-1
                shared = DynamicCache(ddp_cache_data=[(kv[i][own], kv[i + 1][own]) for i in range(0, len(kv), 2)])
                mask = torch.cat([p_mask[own], rollout.completion_mask[rows, :t - 1]], 1)  # [b, P+t-1]
                pos = p_mask[own].sum(1, keepdim=True) + torch.arange(t - 1, device=mask.device)
                h = body(input_ids=tokens[:, :-1], attention_mask=mask, position_ids=pos, use_cache=True,
                         **{cache_key: shared}).last_hidden_state  # [b, t-1, D]
                hidden = torch.cat([hidden, h], 1)  # [b, t, D]
            logp, entropy = head_logprobs(hidden.flatten(0, 1), head.weight, tokens.flatten(),
                                          with_entropy=with_entropy)
            logp = torch.nn.functional.pad(logp.view(-1, t), (0, width - t)) * rollout.completion_mask[rows]  # [b, T]
            if with_entropy:
                entropy = torch.nn.functional.pad(entropy.view(-1, t), (0, width - t)) * rollout.completion_mask[rows]
                entropies.append(entropy)
            if backward is not None:
                backward(rows, logp, entropy).backward()
                logp = logp.detach()
            pieces.append(logp)
    if backward is not None and any(t.grad is not None for t in prompt):
        torch.autograd.backward([x for x, t in zip(inputs, prompt) if t.grad is not None],
                                [t.grad for t in prompt if t.grad is not None])
    back = torch.argsort(torch.tensor(order, device=which.device))  # rows back from length order to the rollout's
    logp = torch.cat(pieces)[back]
    if not with_entropy:
        return logp
    return logp, torch.cat(entropies)[back].detach()


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


def full_sequence_logprobs(model, rollout: Rollout, *, with_entropy: bool = False):
    """`sequence_logprobs` the plain way: every row's whole padded prompt + completion through the model.

    Only the last T+1 positions go through the LM head (`logits_to_keep`); `token_logprobs` chunks the
    log-softmax over the vocabulary, in fp32 outside autocast (bf16 logits are upcast one chunk at a time).
    """
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)  # [N, P+T]
    mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], 1)
    T = rollout.completion_ids.shape[1]
    with autocast(model):
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=False,
                       logits_to_keep=T + 1).logits[:, :-1]  # [N, T, V]: position P-1+t predicts token t
    logp = token_logprobs(logits, rollout.completion_ids) * rollout.completion_mask
    if not with_entropy:
        return logp
    with torch.no_grad():
        return logp, token_entropy(logits.detach()) * rollout.completion_mask


def char_ends_to_token_index(tokenizer, completion_ids: list[int], char_ends: list[int]) -> list[int]:
    """Index of the completion token that holds each character end (exclusive end -> its last char).

    Exact: it decodes token prefixes the same way the completion text was decoded, so a multi-byte
    or multi-character token maps correctly. Binary search keeps it at O(K log T) decodes.
    """
    cache: dict[int, int] = {}

    def text_len(j: int) -> int:  # characters decoded from tokens [0, j]
        if j not in cache:
            cache[j] = len(tokenizer.decode(completion_ids[: j + 1], skip_special_tokens=True))
        return cache[j]

    out = []
    for end in char_ends:
        lo, hi = 0, len(completion_ids) - 1
        while lo < hi:  # first token whose prefix covers `end` characters
            mid = (lo + hi) // 2
            if text_len(mid) >= end:
                hi = mid
            else:
                lo = mid + 1
        out.append(lo)
    return out
