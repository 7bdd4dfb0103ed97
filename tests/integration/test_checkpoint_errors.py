"""Resume from a checkpoint whose JSON parses but has the wrong shape: one line, exit 2, before the model loads."""

from __future__ import annotations

import json

import pytest

from grpo_cli import checkpoint, recipe
from tests.helpers.cli import one_line_error, run_cli

# (file, change, what the error line says)
CASES = {
    "state is a list": ("trainer_state.json", lambda d: [], "must be an object"),
    "step is text": ("trainer_state.json", lambda d: {**d, "step": "two"}, '"step" must be an integer >= 0'),
    "lr is text": ("optimizer.json", lambda d: {**d, "param_groups": [{**d["param_groups"][0], "lr": "x"}]},
                   '"param_groups.0.lr" must be a number'),
    "last_epoch is text": ("scheduler.json", lambda d: {**d, "last_epoch": "x"}, '"last_epoch" must be an integer'),
}


@pytest.mark.parametrize("case", list(CASES))
def test_resume_from_a_file_of_the_wrong_shape_is_one_line_before_the_model_loads(trained_run_copy, monkeypatch,
                                                                                   case):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(recipe, "build_policy", refuse)
    name, change, expected = CASES[case]
    for ckpt in checkpoint.list_checkpoints(trained_run_copy):
        file = ckpt / name
        file.write_text(json.dumps(change(json.loads(file.read_text()))))
    line = one_line_error(run_cli(["train", f"resume={trained_run_copy}", "trainer.max_steps=3"]))
    assert expected in line and name in line, line
