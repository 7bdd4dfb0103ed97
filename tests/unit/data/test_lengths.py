"""grpo_cli.lengths: every prompt of a user's data measured in one pass, each over the limit named by its row,
counted exactly (shared few-shot turns counted once), a fix offered only where the model's context holds it."""

from __future__ import annotations

import json
import re
import time

import pytest

from grpo_cli.data import load_task
from grpo_cli.errors import DataError
from grpo_cli.lengths import check_prompt_lengths
from grpo_cli.policy import char_tokenizer
from grpo_cli.recipe import templated_rows
from grpo_cli.rollout import render_prompts


def check(task, tokenizer, max_prompt_tokens: int, **kwargs) -> None:
    """check_prompt_lengths on the task's rows templated as the sampler templates them, as recipe.check_lengths."""
    check_prompt_lengths(templated_rows(task, tokenizer), tokenizer, max_prompt_tokens, **kwargs)


def write(path, rows: list[dict]):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_jsonl_task_names_the_file_and_line(tmp_path):
    path = write(tmp_path / "p.jsonl", [{"question": "q" * (30 if i == 4 else 1) + str(i), "answer": "1"}
                                        for i in range(8)])
    task = load_task("jsonl", path=str(path), heldout_size=1, seed=3)
    with pytest.raises(DataError, match=re.escape(f"{path}:5: the prompt is ")):
        check(task, char_tokenizer(), 40, context=None, max_new_tokens=8)
    check(task, char_tokenizer(), 80, context=None, max_new_tokens=8)  # all fit


def test_a_fix_past_the_model_context_is_not_offered(tmp_path):
    path = write(tmp_path / "d.jsonl", [{"prompt": "p" * 150}, {"prompt": "q"}, {"prompt": "r"}])
    task = load_task("hf", path=str(path), heldout_size=1, seed=0)
    with pytest.raises(DataError) as err:
        # 150+ tokens + 8 new ones do not fit a context of 100: raising max_prompt_tokens cannot help
        check(task, char_tokenizer(), 50, context=100, max_new_tokens=8)
    assert "sampler.max_prompt_tokens=" not in str(err.value)
    assert "the model's context holds 100 tokens" in str(err.value)


def test_gsm8k_is_measured_in_one_cheap_pass(gsm8k_path):
    task = load_task("hf", path=str(gsm8k_path), prompt_field="question")
    start = time.perf_counter()
    check(task, char_tokenizer(), 1024, context=None, max_new_tokens=256)
    # 7,273 training prompts rendered and tokenized in one batch: ~1 s here on a busy 2-core machine
    assert time.perf_counter() - start < 15


def test_prompts_sharing_few_shot_turns_are_counted_exactly(tmp_path):
    path = write(tmp_path / "p.jsonl", [{"question": f"What is {i} + {i * 7}?" + " Think." * (i % 5), "answer": "1"}
                                        for i in range(30)])
    task = load_task("jsonl", path=str(path), few_shot=2, system_prompt="Be brief.", heldout_size=3)
    tokenizer = char_tokenizer()
    exact = max(len(ids) for ids in tokenizer([str(t) for t in render_prompts(
        tokenizer, [m for _, m in task.prompt_rows()])], add_special_tokens=False).input_ids)
    # the shared system and few-shot turns are counted once and added to each row's own count: the same total
    with pytest.raises(DataError, match=rf"or set sampler.max_prompt_tokens={exact}$"):
        check(task, tokenizer, exact - 1, context=None, max_new_tokens=8)
    check(task, tokenizer, exact, context=None, max_new_tokens=8)
