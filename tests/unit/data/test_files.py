"""Data files as users write them: a UTF-8 BOM, bytes that are not UTF-8, NaN or infinite answers, empty files and
duplicate questions, each named by file and line, and the held-out size the error suggests works."""

from __future__ import annotations

import json
import re

import pytest

from grpo_cli.data import load_task
from grpo_cli.errors import DataError


def lines(*records: str) -> bytes:
    return "".join(r + "\n" for r in records).encode()


PROBLEMS = [f'{{"question": "q{i}", "answer": "{i}"}}' for i in range(6)]


def test_a_utf8_bom_is_accepted(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + lines(*PROBLEMS))
    task = load_task("jsonl", path=str(path), heldout_size=1)
    # the BOM is not part of the first question
    assert sorted(e["question"] for e in task.train + task.heldout) == [f"q{i}" for i in range(6)]


@pytest.mark.parametrize("line3, message", [
    # "café" in Latin-1: '{"question": "caf' is 17 bytes, so 0xe9 is byte 18
    (b'{"question": "caf\xe9", "answer": "1"}', "{path}:3: not UTF-8 text (byte 0xe9 at byte 18 of the line); "
                                                "save the file as UTF-8"),
    (b'{"question": "q", "answer": NaN}', "{path}:3: field 'answer' is nan (often a missing value written as NaN)"),
    (b'{"question": "q", "answer": -Infinity}', "{path}:3: field 'answer' is -inf"),
    (b'{"question": "q", "answer": 1e999}', "{path}:3: field 'answer' is inf"),
    (b'{"question": "q", "answer": " NaN "}', "{path}:3: the answer is 'NaN', not a finite number"),
    (b'{"question": "q", "answer": "inf"}', "{path}:3: the answer is 'inf', not a finite number"),
], ids=["latin-1", "NaN", "-Infinity", "1e999", "'NaN'", "'inf'"])
def test_bad_line_is_named_by_file_and_line(tmp_path, line3, message):
    path = tmp_path / "p.jsonl"
    path.write_bytes(lines(*PROBLEMS[:2]) + line3 + b"\n" + lines(*PROBLEMS[2:]))
    with pytest.raises(DataError) as err:
        load_task("jsonl", path=str(path), heldout_size=1)
    assert str(err.value).startswith(message.format(path=path)) and "\n" not in str(err.value)


def test_gsm8k_answer_nan_is_named(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(lines(*[json.dumps({"question": f"q{i}", "answer": f"work\n#### {i}"}) for i in range(3)],
                           json.dumps({"question": "q", "answer": "work\n#### nan"})))
    with pytest.raises(DataError, match=re.escape(f"{path}:4: the answer is 'nan', not a finite number")):
        load_task("gsm8k", path=str(path), heldout_size=1)


def test_empty_file_says_it_is_empty(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n  \n")
    with pytest.raises(DataError, match=re.escape(f"{path} holds no records (an empty file, or blank lines only)")):
        load_task("jsonl", path=str(path))


def test_all_duplicates_asks_for_other_questions(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(lines(*['{"question": "What is 2+2?", "answer": "4"}'] * 10))
    with pytest.raises(DataError) as err:
        load_task("jsonl", path=str(path), heldout_size=1)
    # lowering heldout_size cannot help (it is 1 already): one question is held out, its 9 copies dropped
    assert "(10 usable records, 1 distinct questions)" in str(err.value)
    assert str(err.value).endswith("add problems with other questions")


@pytest.mark.parametrize("questions, few_shot, heldout_size", [
    (["a", "b", "c", "d"], 0, 3),  # 4 distinct, all held out by 200 -> at most 4 - 0 - 1 = 3
    (["a", "b", "c", "d", "e"], 2, 2),  # 5 distinct, 2 shots -> at most 5 - 2 - 1 = 2
    (["a", "a", "b", "b", "c", "c"], 0, 2),  # 3 distinct, each twice -> at most 3 - 0 - 1 = 2
])
def test_suggested_heldout_size_works(tmp_path, questions, few_shot, heldout_size):
    path = tmp_path / "p.jsonl"
    path.write_bytes(lines(*[json.dumps({"question": q, "answer": "1"}) for q in questions]))
    with pytest.raises(DataError, match=re.escape(f"set data.heldout_size={heldout_size} or lower")):
        load_task("jsonl", path=str(path), few_shot=few_shot, heldout_size=200)
    for seed in range(5):  # the fix holds whichever rows the seed holds out
        task = load_task("jsonl", path=str(path), few_shot=few_shot, heldout_size=heldout_size, seed=seed)
        assert len(task.train) >= 1 and len(task.shots) == few_shot
