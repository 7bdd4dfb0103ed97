"""examples/calculator/run.py's `--demo turns` variant: two demonstrated calls as earlier turns of every
conversation, train and held-out alike, that are themselves right (the call parses, the calculator gives the tool
turn's result, the demonstrated answer scores 1) and load as data=hf's train and held-out splits."""

from __future__ import annotations

import importlib.util
import json

import pytest

from grpo_cli.config import compose
from grpo_cli.env.formats import CHATML_TOOLS_TEMPLATE, ToolFormat
from grpo_cli.instantiate import build
from tests.helpers import REPO

HERE = REPO / "examples" / "calculator"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"calculator_example_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


run, calculator, reward = load("run"), load("calculator"), load("answer_reward")


def test_the_demonstrated_turns_are_right_calls_with_right_answers():
    turns = run.DEMO_TURNS["turns"]
    assert run.DEMO_TURNS["turn"] == turns[:4]  # --demo turn: the first of the two
    assert [m["role"] for m in turns] == ["user", "assistant", "tool", "assistant"] * 2
    fmt = ToolFormat("chatml", CHATML_TOOLS_TEMPLATE)
    for k in (0, 4):
        [call] = fmt.parse(turns[k + 1]["content"])  # read as the episode reads the model's calls
        assert call.error is None and call.name == "calculator"
        result = calculator.calculator(**call.arguments)  # 123 * 45 = 5535; 608 * 37 = 22496
        assert turns[k + 2]["content"] == result
        assert reward.correct([turns[k + 1:k + 4]], [result]) == [1.0]
    assert [turns[2]["content"], turns[6]["content"]] == ["5535", "22496"]


@pytest.mark.parametrize("demo", ["turn", "turns"])
def test_turns_data_puts_the_demonstrations_before_every_question_of_both_splits(tmp_path, demo):
    folder = run.turns_data(tmp_path, demo)
    for source, split, count in (("train.jsonl", "train", 400), ("heldout.jsonl", "test", 50)):
        plain = [json.loads(line) for line in (HERE / source).read_text().splitlines()]
        rows = [json.loads(line) for line in (folder / f"{split}.jsonl").read_text().splitlines()]
        assert len(rows) == len(plain) == count
        assert all(r["prompt"] == [*run.DEMO_TURNS[demo], {"role": "user", "content": p["prompt"]}]
                   and r["answer"] == p["answer"] for r, p in zip(rows, plain))
    # grpo train data=hf data.path=FOLDER: the test split is the held-out set, each prompt used as it is
    task = build(compose("train", ["data=hf", f"data.path={folder}"]).data)
    assert len(task.heldout) == 50 and task.heldout[0]["messages"][:-1] == run.DEMO_TURNS[demo]
    assert task.heldout[0]["question"].startswith("What is ")  # the real question, not a demonstration's
