"""Every prompt of a user's data (training and held-out rows) is measured in tokens, with the chat template, before the
model loads: one longer than sampler.max_prompt_tokens is one line naming its row, whether or not a step draws it."""

from __future__ import annotations

import json
import re

import pytest

from grpo_cli import recipe
from tests.helpers.cli import one_line_error, run_cli

TINY = ["model=tiny", "sampler.max_new_tokens=8", "algo.group_size=2", "trainer.prompts_per_step=2",
        "trainer.micro_batch_size=4", "trainer.warmup_steps=0", "trainer.report_to=[]", "trainer.max_steps=1"]


def write(path, rows: list[dict]):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture()
def refuse_model(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(recipe, "build_policy", refuse)


@pytest.mark.parametrize("prompt, expected", [
    # the tiny model's tokenizer has one token per character: 200 characters + the chat template's tokens > 64
    ("x" * 200, r"d.jsonl row 40: the prompt is 2\d\d tokens with the chat template, longer than "
                r"sampler.max_prompt_tokens \(64\); shorten or remove that row \(1 of 40 rows is over\), or set "
                r"sampler.max_prompt_tokens=2\d\d"),
    # 1 MB is refused by its length in characters (more than 64 a token), never tokenized
    ("y" * 2**20, r"d.jsonl row 40: the prompt is 1,048,6\d\d characters with the chat template, longer than "
                  r"sampler.max_prompt_tokens \(64\) allows; shorten or remove that row \(1 of 40 rows is over\)"),
], ids=["tokens", "1MB"])
def test_a_long_prompt_on_any_row_stops_the_run_before_the_model_loads(tmp_path, refuse_model, prompt, expected):
    write(tmp_path / "d.jsonl", [{"prompt": f"p{i}"} for i in range(39)] + [{"prompt": prompt}])
    result = run_cli(["train", *TINY, "data=hf", "data.path=d.jsonl", "data.heldout_size=1",
                      "sampler.max_prompt_tokens=64", "reward=custom", "reward.funcs=[format]", "hydra.run.dir=run"],
                     cwd=tmp_path)
    line = one_line_error(result)
    assert re.search(expected, line), line
