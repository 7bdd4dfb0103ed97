"""Rollouts: G completions per prompt from the policy -> a `Rollout` of padded token tensors.

Prompts are rendered with the tokenizer's chat template, left-padded (so every completion starts
at the same column) and prefilled once per prompt: the prompt's KV cache is computed for the B
unique prompts, repeated G times, and generation continues from it, so the G samples of a group
share one prompt prefill (HF `generate` alone would prefill every copy).

Position ids follow HF generate (cumsum of the attention mask - 1), and `sequence_logprobs`
uses the same ones, so the training forward scores exactly the tokens the sampler produced.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_cli.objective import token_entropy, token_logprobs


@dataclass
class Rollout:
    """N = B * G sequences; row i belongs to prompt i // G."""

    prompt_ids: torch.Tensor  # [N, P] left-padded
    prompt_mask: torch.Tensor  # [N, P] 1 on real prompt tokens
    completion_ids: torch.Tensor  # [N, T] right-padded with pad_token_id
    completion_mask: torch.Tensor  # [N, T] 1 up to and including the EOS token
    texts: list[str]  # N decoded completions, special tokens skipped
    truncated: list[bool]  # N: no EOS within max_new_tokens

    @property
    def lengths(self) -> list[int]:
        return self.completion_mask.sum(1).tolist()

    def select(self, rows: torch.Tensor | list[int]) -> "Rollout":
        rows = torch.as_tensor(rows, dtype=torch.long)
        pick = rows.tolist()
        return Rollout(self.prompt_ids[rows], self.prompt_mask[rows], self.completion_ids[rows],
                       self.completion_mask[rows], [self.texts[i] for i in pick], [self.truncated[i] for i in pick])


def render_prompts(tokenizer, conversations: list[list[dict]]) -> list[str]:
    """Chat-template each conversation, ending with the assistant's turn opened."""
    return [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in conversations]


class Sampler:
    """Sampling settings (the `sampler` config group) and the generate call that uses them."""

    def __init__(self, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, max_new_tokens: int = 64):
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.max_new_tokens = max_new_tokens

    @torch.no_grad()
    def generate(self, model, tokenizer, prompts: list[str], n: int, *, greedy: bool = False,
                 max_new_tokens: int | None = None, temperature: float | None = None) -> Rollout:
        """`n` completions for each prompt string (already chat-templated), rows grouped by prompt."""
        device = next(model.parameters()).device
        tokenizer.padding_side = "left"
        enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        ids, mask = enc.input_ids, enc.attention_mask  # [B, P]
        eos = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        settings = dict(do_sample=False) if greedy else dict(
            do_sample=True, temperature=temperature or self.temperature, top_p=self.top_p, top_k=self.top_k or None)
        was_training = model.training
        model.eval()
        # prefill each unique prompt once (all but its last token, which generate feeds itself)
        prefill = {}
        if ids.shape[1] > 1:
            out = model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=position_ids(mask[:, :-1]),
                        use_cache=True)
            # transformers >= 5.2x calls the KV cache `cache`; earlier releases `past_key_values`
            key = "cache" if "cache" in out else "past_key_values"
            prefill[key] = out[key]
            if n > 1:
                prefill[key].batch_repeat_interleave(n)
        full = model.generate(input_ids=ids.repeat_interleave(n, 0), attention_mask=mask.repeat_interleave(n, 0),
                              **prefill, max_new_tokens=max_new_tokens or self.max_new_tokens,
                              eos_token_id=eos, pad_token_id=pad, num_return_sequences=1, **settings)
        model.train(was_training)
        completion = full[:, ids.shape[1]:]  # [N, T']
        return _finish(tokenizer, ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0), completion, eos, pad)


def _finish(tokenizer, prompt_ids, prompt_mask, completion, eos: int, pad: int) -> Rollout:
    """Mask everything after the first EOS; a completion with no EOS is truncated."""
    is_eos = completion == eos
    has_eos = is_eos.any(1)
    first_eos = torch.where(has_eos, is_eos.int().argmax(1), completion.shape[1])  # [N]
    cols = torch.arange(completion.shape[1], device=completion.device)
    mask = (cols[None, :] <= first_eos[:, None]).long()  # [N, T], EOS itself included
    completion = completion.masked_fill(mask == 0, pad)
    texts = tokenizer.batch_decode([row[m.bool()] for row, m in zip(completion, mask)], skip_special_tokens=True)
    return Rollout(prompt_ids, prompt_mask, completion, mask, texts, (~has_eos).tolist())


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as HF generate computes them. [N, L]"""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.masked_fill(attention_mask == 0, 0)


def sequence_logprobs(model, rollout: Rollout, *, with_entropy: bool = False):
    """Log-probs of the completion tokens under `model`: [N, T] (and entropies [N, T] if asked).

    Only the last T+1 positions go through the LM head (`logits_to_keep`), so no logits are made
    for prompt positions; `token_logprobs` chunks the log-softmax over the vocabulary.
    """
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)  # [N, P+T]
    mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], 1)
    T = rollout.completion_ids.shape[1]
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=False,
                   logits_to_keep=T + 1).logits[:, :-1]  # [N, T, V]: position P-1+t predicts token t
    logp = token_logprobs(logits, rollout.completion_ids)
    if not with_entropy:
        return logp
    with torch.no_grad():
        return logp, token_entropy(logits.detach())


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
