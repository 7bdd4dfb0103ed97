"""`data.heldout_size=auto` (the file tasks' setting): a small dataset holds out a tenth of its rows, said in one
console line, and trains as it is; a large one (GSM8K) holds out exactly the rows it held out before."""

from __future__ import annotations

import json

import pytest

from grpo_cli.data import load_task
from grpo_cli.errors import ConfigError


def write(path, rows: list[dict]):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# the two rows of docs/your-own-task.md
DOCS_ROWS = [{"prompt": "How far is it from Paris to Lyon?", "unit": "km", "answer": "465"},
             {"prompt": "How much does a litre of water weigh?", "unit": "kg", "answer": "1"}]


def test_a_120_row_dataset_holds_out_a_tenth_and_says_so(tmp_path, capsys):
    path = write(tmp_path / "d.jsonl", [{"prompt": f"p{i}", "answer": str(i)} for i in range(120)])
    task = load_task("hf", path=str(path))
    assert (len(task.train), len(task.heldout)) == (108, 12)  # 120 // 10 = 12 held out
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"data: 12 of {path}'s 120 rows held out for eval (data.heldout_size=auto: a tenth, at least "
                     f"1, at most 200); set data.heldout_size=N for another number"]


@pytest.mark.parametrize("task, rows", [
    ("hf", DOCS_ROWS),
    ("jsonl", [{"question": r["prompt"], "answer": r["answer"]} for r in DOCS_ROWS]),
])
def test_the_docs_two_row_examples_train_as_written(tmp_path, task, rows):
    built = load_task(task, path=str(write(tmp_path / "d.jsonl", rows)))
    assert (len(built.train), len(built.heldout)) == (1, 1)  # at least one held out, at least one to train on


def test_auto_leaves_a_question_to_train_on_and_a_shot(tmp_path):
    # 30 rows, 3 distinct questions, 1 shot: a tenth (3) could hold out every question; 3 - 1 - 1 = 1 is held out
    path = write(tmp_path / "d.jsonl", [{"question": q, "answer": "1"} for q in "abc" * 10])
    for seed in range(5):
        task = load_task("jsonl", path=str(path), few_shot=1, seed=seed)
        assert len(task.train) >= 1 and len(task.shots) == 1


def test_a_number_is_still_taken_as_it_is(tmp_path):
    path = write(tmp_path / "d.jsonl", [{"prompt": f"p{i}"} for i in range(120)])
    assert len(load_task("hf", path=str(path), heldout_size=30).heldout) == 30


@pytest.mark.parametrize("value", ["half", 0, -3, 1.5, True])
def test_anything_else_is_refused_with_the_fix(tmp_path, value):
    path = write(tmp_path / "d.jsonl", [{"prompt": f"p{i}"} for i in range(20)])
    with pytest.raises(ConfigError, match=r"data.heldout_size \(.*\) must be an integer >= 1 or auto; set "
                                          r"data.heldout_size=auto"):
        load_task("hf", path=str(path), heldout_size=value)


def test_a_generated_task_needs_a_number():
    with pytest.raises(ConfigError, match=r"data.heldout_size=auto is for data read from files.*set "
                                          r"data.heldout_size=500"):
        load_task("arithmetic", heldout_size="auto")


@pytest.mark.parametrize("task, field", [("gsm8k", None), ("hf", "question"), ("jsonl", None)])
def test_gsm8k_holds_out_the_same_200_rows_as_before(gsm8k_path, capsys, task, field):
    extra = {"prompt_field": field} if field else {}
    if task == "jsonl":
        extra = {"answer_regex": r"####\s*(.+)$"}
    auto = load_task(task, path=str(gsm8k_path), **extra)
    fixed = load_task(task, path=str(gsm8k_path), heldout_size=200, **extra)
    assert len(auto.heldout) == 200
    assert [e["question"] for e in auto.heldout] == [e["question"] for e in fixed.heldout]
    assert len(auto.train) == len(fixed.train)
    assert "held out" not in capsys.readouterr().err  # a large dataset's slice is as it was: nothing to say
