"""The HF-generate rollout engine: transformers `generate` on the policy itself, with a shared prefill.

Each unique prompt's KV cache is computed once, repeated G times, and generation continues from it,
so the G samples of a group share one prompt prefill (HF `generate` alone would prefill every copy).
The engine samples from the policy object the trainer updates, so `sync` has nothing to do.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from transformers import GenerationConfig

from grpo_cli.lengths import check_prompts
from grpo_cli.policy import autocast, pad_id, position_ids
from grpo_cli.rollout import Rollout, Sampler, drawing_from, encode_prompts, finish


@dataclass
class HFSampler(Sampler):
    """The shared sampler settings (conf/sampler/default.yaml) and transformers `generate` on the policy."""

    engine_name = "HF generate"  # the console's name for it (engine.say); a class attribute, not a setting

    @torch.no_grad()
    def _generate(self, model, tokenizer, prompts: list[str], n: int, *, greedy: bool, max_new_tokens: int,
                  temperature: float, generator: torch.Generator | None) -> Rollout:
        device = next(model.parameters()).device
        check_prompts(model, tokenizer, prompts, self.max_prompt_tokens, max_new_tokens)
        ids, mask = (t.to(device) for t in encode_prompts(tokenizer, prompts))  # [B, P], left-padded
        eos, pad = tokenizer.eos_token_id, pad_id(tokenizer)
        config = sampling_config(greedy, temperature, self.top_p, self.top_k, max_new_tokens, eos, pad)
        was_training = model.training
        model.eval()
        with autocast(model):
            # prefill each unique prompt once (all but its last token, which generate feeds itself); only the
            # cache is wanted, so one position's logits ([B, 1, V]) instead of the prompt's ([B, P-1, V])
            prefill = {}
            if ids.shape[1] > 1:
                out = model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1],
                            position_ids=position_ids(mask[:, :-1]), use_cache=True, logits_to_keep=1)
                # transformers >= 5.2x calls the KV cache `cache`; earlier releases `past_key_values`
                key = "cache" if "cache" in out else "past_key_values"
                prefill[key] = out[key]
                if n > 1:
                    prefill[key].batch_repeat_interleave(n)
            # generate runs the last prompt token and every new one; it asks for the last position's logits
            # only (logits_to_keep=1, transformers 5 does so for models whose forward takes it)
            with own_generation_config(model), drawing_from(generator):
                full = model.generate(input_ids=ids.repeat_interleave(n, 0),
                                      attention_mask=mask.repeat_interleave(n, 0), **prefill,
                                      generation_config=config)
        model.train(was_training)
        completion = full[:, ids.shape[1]:]  # [N, T']
        return finish(tokenizer, ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0), completion, eos, pad)

    def engine(self, policy, tokenizer, *, greedy: bool, generator: torch.Generator | None,
               temperature: float | None = None) -> HFEngine:
        return HFEngine(self, policy, tokenizer, greedy, generator, temperature)


@dataclass
class HFEngine:
    """grpo_cli.env's Engine on transformers `generate`: token-id sequences in, each row's new ids out (up to and
    including its EOS), sampled with the sampler's settings from `generator` (greedy for eval; `temperature`, when
    given, in place of the sampler's: eval's samples)."""

    sampler: HFSampler
    model: torch.nn.Module
    tokenizer: object
    greedy: bool
    generator: torch.Generator | None
    temperature: float | None = None

    @property
    def eos_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @torch.no_grad()
    def continue_batch(self, sequences: list[list[int]], max_new: int) -> list[list[int]]:
        model, s = self.model, self.sampler
        device = next(model.parameters()).device
        eos, pad = self.eos_token_id, pad_id(self.tokenizer)
        width = max(len(q) for q in sequences)
        ids = torch.full((len(sequences), width), pad, dtype=torch.long)  # [B, L] left-padded
        mask = torch.zeros_like(ids)
        for i, q in enumerate(sequences):
            ids[i, width - len(q):], mask[i, width - len(q):] = torch.tensor(q, dtype=torch.long), 1
        config = sampling_config(self.greedy, self.temperature or s.temperature, s.top_p, s.top_k, max_new, eos, pad)
        was_training = model.training
        model.eval()
        with autocast(model), own_generation_config(model), drawing_from(self.generator):
            full = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config)
        model.train(was_training)
        out = []
        for row in full[:, width:].tolist():  # [B, T'] new ids, finished rows padded
            out.append(row[:row.index(eos) + 1] if eos in row else row)
        return out


def sampling_config(greedy: bool, temperature: float, top_p: float, top_k: int, max_new_tokens: int, eos: int,
                    pad: int):
    """The generation settings of a rollout: greedy, or the policy's softmax at `temperature` with only
    the top-p/top-k the sampler config asks for (top_k 0 = off, passed as 0 so no default applies)."""
    sample = {} if greedy else {"temperature": temperature, "top_p": top_p, "top_k": top_k}
    return GenerationConfig(do_sample=not greedy, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad,
                            num_return_sequences=1, **sample)


@contextlib.contextmanager
def own_generation_config(model):
    """Generate without the model's shipped generation defaults.

    `generate` fills every field it is not given from the model's `generation_config`, and models ship
    sampling defaults (Qwen2.5-Instruct: repetition_penalty 1.05-1.1, top_k 20; others min_p,
    no_repeat_ngram_size, ...): completions would come from a penalized, truncated distribution while
    the loss scores the plain one. For the call, the model's config is a blank GenerationConfig, so
    only what `sampling_config` sets (and transformers' neutral defaults) applies.
    """
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    shipped = inner.generation_config
    inner.generation_config = GenerationConfig()
    try:
        yield
    finally:
        inner.generation_config = shipped
