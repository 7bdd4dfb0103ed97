"""A user's `data=hf` rows, every one checked when the task is built (before the model loads): a prompt of the
wrong type, or bytes that are not UTF-8 in any column, on any row is one DataError naming that row; an empty file and
a file whose prompts are all the same are named for what they are, with a fix that works."""

from __future__ import annotations

import json
import re

import pytest

from grpo_cli.data import load_task
from grpo_cli.errors import DataError

ROWS = [{"prompt": f"Say w{i}.", "answer": str(i)} for i in range(8)]


def write(path, rows: list[dict], tail: bytes = b""):
    path.write_bytes("".join(json.dumps(r) + "\n" for r in rows).encode() + tail)
    return path


def refusal(path, **overrides) -> str:
    with pytest.raises(DataError) as err:
        load_task("hf", path=str(path), heldout_size=1, **overrides)
    line = str(err.value)
    assert "\n" not in line
    return line


@pytest.mark.parametrize("tail, expected", [
    # row 9 of 9: every row is read, not just the first
    (b'{"prompt": 5, "answer": "x"}\n', r"row 9: 'prompt' holds int \(5\), not a string like row 1's"),
    (b'{"prompt": [{"role": "user", "content": "x"}], "answer": "x"}\n',
     r"row 9: 'prompt' holds list \(.*\), not a string like row 1's"),
    (b'{"prompt": ["a", "b"], "answer": "x"}\n', r"row 9: 'prompt' holds list \(.*\), not a string like row 1's"),
    # "caf" + 0xe9 (Latin-1 e-acute)
    (b'{"prompt": "caf\xe9", "answer": "1"}\n', r"row 9: 'prompt' is not UTF-8 text \(byte 0xe9\); save the file "
                                                 r"as UTF-8"),
], ids=["int", "messages-after-strings", "list", "latin-1"])
def test_a_bad_prompt_on_a_later_row_is_named_by_its_row(tmp_path, tail, expected):
    line = refusal(write(tmp_path / "d.jsonl", ROWS, tail))
    assert re.search(expected, line), line


def test_bytes_that_are_not_utf8_on_the_first_row_are_one_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "caf\xe9", "answer": "1"}\n' + write(tmp_path / "rest.jsonl", ROWS).read_bytes())
    assert re.search(r"row 1: 'prompt' is not UTF-8 text \(byte 0xe9\)", refusal(path))


# 49 good rows, then row 50 with "caf" + 0xe9 (Latin-1 e-acute) in a column other than the prompt: every column reaches
# the reward functions, so a row read at step 3 must not end the run with a UnicodeDecodeError traceback
LATE = [{"prompt": f"Say w{i}.", "answer": str(i), "tags": ["t"]} for i in range(49)]


@pytest.mark.parametrize("row50, column", [
    (b'{"prompt": "Say w49.", "answer": "caf\xe9", "tags": ["t"]}\n', "answer"),
    (b'{"prompt": "Say w49.", "answer": "49", "tags": ["t", "caf\xe9"]}\n', "tags"),  # inside a list
], ids=["answer", "in-a-list"])
def test_bytes_that_are_not_utf8_in_any_column_are_named_by_row_and_column(tmp_path, row50, column):
    line = refusal(write(tmp_path / "d.jsonl", LATE, row50))
    assert re.search(rf"row 50: {column!r} is not UTF-8 text \(byte 0xe9\); save the file as UTF-8$", line), line


def test_a_csv_with_bytes_that_are_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "d.csv"
    rows = b"".join(b"Say w%d.,%d\n" % (i, i) for i in range(49))
    path.write_bytes(b"prompt,answer\n" + rows + b"Say w49.,caf\xe9\n")
    line = refusal(path)
    # the row and the column, as for JSON (Arrow's CSV reader says only "Invalid UTF8 sequence at string index 49")
    assert line == f"{path} row 50: 'answer' is not UTF-8 text (byte 0xe9); save the file as UTF-8", line


def test_messages_then_a_string_is_named_by_its_row(tmp_path):
    chat = [{"prompt": [{"role": "user", "content": f"q{i}"}]} for i in range(4)]
    line = refusal(write(tmp_path / "d.jsonl", chat, b'{"prompt": "plain"}\n'))
    assert re.search(r"row 5: 'prompt' holds str \('plain'\), not a list of \{\"role\", \"content\"\} messages "
                     r"like row 1's", line), line


@pytest.mark.parametrize("text", ["", "\n  \n"], ids=["empty", "blank-lines"])
def test_an_empty_file_says_it_is_empty(tmp_path, text):
    path = tmp_path / "d.jsonl"
    path.write_text(text)
    line = refusal(path)
    assert line == f"{path} is empty (no rows); set data.path=... to a file with one prompt per row", line


def test_identical_prompts_name_the_problem_not_a_heldout_size(tmp_path):
    path = write(tmp_path / "d.jsonl", [{"prompt": "Same?", "answer": "1"}] * 10)
    line = refusal(path)
    assert "heldout_size" not in line  # no held-out size leaves a training prompt: every row asks the same
    assert line.startswith(f"{path}: all 10 rows have the same prompt") and line.endswith(
        "add rows with other prompts"), line


def test_the_heldout_size_suggested_for_few_distinct_prompts_works(tmp_path):
    # 3 distinct prompts, 4 rows each: holding out 3 can hold out every prompt
    path = write(tmp_path / "d.jsonl", [{"prompt": p} for p in "abc" * 4])
    with pytest.raises(DataError, match=r"set data.heldout_size=2 \(3 distinct prompts\)"):
        load_task("hf", path=str(path), heldout_size=3)
    for seed in range(5):
        assert len(load_task("hf", path=str(path), heldout_size=2, seed=seed).train) >= 1
