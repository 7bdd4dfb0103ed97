"""Prompt lengths, every check in one place: a prompt over `sampler.max_prompt_tokens` is one DataError that names
it, before it costs a step, and a refusal's fix is one that can work.

- `check_prompt_lengths(rows, ...)`: every row of a user's data (training and held-out), chat-templated as the
  sampler templates them (the caller renders them: `recipe.templated_rows`), measured once before the model loads
  and tokenized in one batch call; the error names the row (its file and line) and how many rows are over.
  Generated tasks (arithmetic, multistep) have no rows to measure: their settings bound their prompts.
- `check_prompts(model, tokenizer, prompts, ...)`: each batch an engine samples (HF generate, vLLM in process, a
  vLLM server), for prompts no data row held (an environment's own, a user's sampler) and for a model whose context
  was unknown before it loaded.
- `length_fix(prompt, new, limit)`: the fix a refusal names when prompt + completion tokens exceed a limit (the
  sampler's config check before the model loads names it too).
A prompt longer than CHARS_PER_TOKEN characters a token allowed is refused by its characters, never tokenized: a
10 MB row must not reach the tokenizer. Episodes' prompts, rendered with the tools' schemas, are counted where the
episode encodes them (rollout.episodes).
"""

from __future__ import annotations

import os

from grpo_cli.errors import ConfigError, DataError

# characters a token can hold at most: a prompt longer than this many per allowed token is refused untokenized
CHARS_PER_TOKEN = 64


def check_prompt_lengths(rows: list[tuple[str, str]], tokenizer, max_prompt_tokens: int, *, context: int | None,
                         max_new_tokens: int) -> None:
    """DataError naming the first of `rows` ((where, templated prompt): training, then held-out) whose prompt is over
    `max_prompt_tokens` (and how many are); the fix offers a larger sampler.max_prompt_tokens only where the model's
    `context` holds it."""
    if not rows:
        return
    texts = [text for _, text in rows]
    bound = CHARS_PER_TOKEN * max_prompt_tokens
    # [rows]: token counts (0: fits for sure, not counted); None for a prompt refused by its characters alone
    counts: list[int | None] = [None if len(text) > bound else 0 for text in texts]
    cut, shared = _shared_prefix(tokenizer, [t for t, n in zip(texts, counts) if n is not None])
    # a token is at least one byte of UTF-8 text, or a word's marker beside it (SentencePiece's "▁"): a prompt of at
    # most half as many bytes as the tokens allowed fits without counting (most of GSM8K at 1024: the tokenizer's
    # batch call is the check's cost)
    uncertain = [i for i, text in enumerate(texts)
                 if counts[i] == 0 and shared + 2 * len(text[cut:].encode()) > max_prompt_tokens]
    if uncertain:
        ids = tokenizer([texts[i][cut:] for i in uncertain], add_special_tokens=False).input_ids
        for i, row_ids in zip(uncertain, ids):
            counts[i] = shared + len(row_ids)
    over = [i for i, n in enumerate(counts) if n is None or n > max_prompt_tokens]
    if not over:
        return
    first, n = over[0], counts[over[0]]
    where = rows[first][0]
    many = f"{len(over)} of {len(rows)} rows {'is' if len(over) == 1 else 'are'} over"
    if n is None:
        raise DataError(f"{where}: the prompt is {len(texts[first]):,} characters with the chat template, longer than "
                        f"sampler.max_prompt_tokens ({max_prompt_tokens}) allows; shorten or remove that row ({many})")
    longest = max(c for c in counts if c is not None)
    if any(counts[i] is None for i in over):  # a row of more characters than any max_prompt_tokens could hold
        fix = ""
    elif context is not None and longest + max_new_tokens > context:
        fix = f" (the model's context holds {context} tokens, {max_new_tokens} of them for the completion)"
    else:
        fix = f", or set sampler.max_prompt_tokens={longest}"
    raise DataError(f"{where}: the prompt is {n} tokens with the chat template, longer than "
                    f"sampler.max_prompt_tokens ({max_prompt_tokens}); shorten or remove that row ({many}){fix}")


def _shared_prefix(tokenizer, texts: list[str]) -> tuple[int, int]:
    """(where every text may be cut, the tokens before it): the start of the last special token within the prefix
    all `texts` share (the system turn and few-shot turns of every prompt), counted once. A fast tokenizer splits
    the text at special tokens before anything else, so the count before the cut and the count after it add up."""
    common = os.path.commonprefix(texts) if texts else ""
    specials = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
    cut = max((common.rfind(s) for s in specials if s), default=-1)
    if cut <= 0:
        return 0, 0
    return cut, len(tokenizer(common[:cut], add_special_tokens=False).input_ids)


def check_prompts(model, tokenizer, prompts: list[str], max_prompt_tokens: int, max_new_tokens: int) -> None:
    """DataError naming the first prompt over `max_prompt_tokens`, or one that cannot fit the model's context.

    A prompt longer than CHARS_PER_TOKEN characters per allowed token is refused before it is tokenized at all: a
    10 MB question must not reach the tokenizer, let alone the model.
    """
    context = getattr(model.config, "max_position_embeddings", None)
    if context is not None and max_prompt_tokens + max_new_tokens > context:
        # config.validate checks this before the model loads wherever the model's config says its context
        raise ConfigError(f"sampler.max_prompt_tokens ({max_prompt_tokens}) + max_new_tokens ({max_new_tokens}) "
                          f"exceed the model's context of {context} tokens; "
                          f"{length_fix(max_prompt_tokens, max_new_tokens, context)}")
    bound = CHARS_PER_TOKEN * max_prompt_tokens
    for prompt in prompts:
        too_long = len(prompt) > bound
        if not too_long:
            count = len(tokenizer(prompt, add_special_tokens=False).input_ids)
            too_long = count > max_prompt_tokens
        if too_long:
            size = f"{len(prompt):,} characters" if len(prompt) > bound else f"{count} tokens"
            raise DataError(f"a prompt of {size} is longer than sampler.max_prompt_tokens ({max_prompt_tokens}): "
                            f"{prompt[:100]!r}...; drop such problems from the data or raise "
                            f"sampler.max_prompt_tokens")


def length_fix(prompt: int, new: int, limit: int, key: str = "sampler.max_new_tokens") -> str:
    """A fix that can work for prompt + new > limit: shorter completions while the prompts leave room, else
    shorter prompts, else both halved."""
    if prompt < limit:
        return f"set {key}={limit - prompt}" + (f" or sampler.max_prompt_tokens={limit - new}" if new < limit else "")
    if new < limit:
        return f"set sampler.max_prompt_tokens={limit - new}"
    return f"set sampler.max_prompt_tokens={limit // 2} and {key}={limit - limit // 2}"
