"""Every prompt of a user's data (training and held-out rows) measured once, before the model loads: one longer
than the sampler allows (`sampler.max_prompt_tokens`) is one DataError naming its row, not a failure on the step
that happens to draw it.

    check_prompt_lengths(task, tokenizer, max_prompt_tokens, context=..., max_new_tokens=...)

The prompts are chat-templated as the sampler templates them (`rollout.render_prompts`) and tokenized in one batch
call. A prompt longer than 64 characters a token allowed is refused by its length in characters, never tokenized
(as `rollout.hf.check_prompts` does): a 10 MB row must not reach the tokenizer. Generated tasks (arithmetic,
multistep) have no rows to measure: their settings bound their prompts (`_Task.prompt_rows`).
"""

from __future__ import annotations

import os

from grpo_cli.data.task import _Task
from grpo_cli.errors import DataError
from grpo_cli.rollout import render_prompts

# characters a token can hold at most, for the bound checked before tokenizing (rollout.hf.check_prompts' too)
CHARS_PER_TOKEN = 64


def check_prompt_lengths(task: _Task, tokenizer, max_prompt_tokens: int, *, context: int | None,
                         max_new_tokens: int) -> None:
    """DataError naming the first row (training, then held-out) whose templated prompt is over `max_prompt_tokens`
    (and how many are); the fix offers a larger sampler.max_prompt_tokens only where the model's `context` holds it."""
    rows = task.prompt_rows()
    if not rows:
        return
    texts = [str(t) for t in render_prompts(tokenizer, [messages for _, messages in rows])]
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
