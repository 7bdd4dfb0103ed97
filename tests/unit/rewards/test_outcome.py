"""Answer extraction, answer matching and the outcome reward functions (grpo_cli.rewards.outcome)."""

from __future__ import annotations

import json
import threading
from fractions import Fraction

import pytest

from grpo_cli.errors import ConfigError
from grpo_cli.rewards import answers_match, extract_answer
from grpo_cli.rewards.outcome import accuracy, format_reward, length_penalty

# (completion, extracted answer). Priority: #### > \boxed > "answer is"/"answer:" > last number.
EXTRACTION = [
    # GSM8K answer line
    ("#### 72", "72"),
    ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", "72"),
    ("#### 1,000", "1000"),
    ("#### -5", "-5"),
    ("#### 3.0", "3.0"),
    ("#### $1,234.50", "1234.50"),
    ("#### 50%", "50"),
    ("#### 18 dollars", "18"),
    ("#### 5.", "5"),
    ("#### 5\nwait, no\n#### 7", "7"),  # the last answer line wins
    ("The answer is 8.\n#### 9", "9"),  # #### outranks the phrase
    ("So the total is 12.\n####", "12"),  # empty answer line -> last number
    # \boxed, braces balanced
    ("\\boxed{42}", "42"),
    ("so $\\boxed{\\frac{3}{4}}$", "3/4"),
    ("\\boxed{\\dfrac{1}{2}}", "1/2"),
    ("\\boxed{-\\frac{3}{4}}", "-3/4"),
    ("$\\boxed{1,000}$", "1000"),
    ("\\boxed{\\$12.50}", "12.50"),
    ("\\boxed{50\\%}", "50"),
    ("\\boxed{x = 5}", "5"),
    ("\\boxed{\\text{18 apples}}", "18"),
    ("\\boxed{\\sqrt{2}}", "\\sqrt{2}"),  # not a plain number: kept for math-verify
    ("\\boxed{\\frac{1}{2}+1}", "\\frac{1}{2}+1"),
    ("first \\boxed{3}, then \\boxed{4}", "4"),
    ("unclosed \\boxed{5", "5"),  # no closing brace -> last number
    # the answer phrase
    ("The answer is 42.", "42"),
    ("The answer is: -5", "-5"),
    ("the answer is $1,234.50.", "1234.50"),
    ("Answer: 3/4", "3/4"),
    ("Final answer: 7 apples", "7"),
    ("The answer is \\frac{2}{3}", "2/3"),
    ("I added 12 and 30. The answer is 42, not 12.", "42"),  # the first number after the phrase
    ("The answer is 1,000,000", "1000000"),
    # the last number
    ("What is 12 + 30? 12 + 30 = 42", "42"),  # the question's numbers are echoed first
    ("There are 5 apples and 3 pears, so 8 fruits in total.", "8"),
    ("It costs $1,234.50", "1234.50"),
    ("The discount is 50%.", "50"),
    ("The temperature fell to -5 degrees", "-5"),
    ("10-5 leaves 5", "5"),
    ("She ate 3/4 of the pie.", "3/4"),
    ("She ate 3/4.", "3/4"),  # a full stop is not a decimal point
    ("The result is 3.0", "3.0"),
    ("We get 1,000 people", "1000"),
    ("half is .5", ".5"),
    ("count 1,2,3", "3"),  # commas between single digits are a list, not thousands
    ("Step 1: 2 + 3 = 5\nStep 2: 5 * 2 = 10", "10"),
    ("no number at all", None),
    ("The answer is x", None),
    ("", None),
]


@pytest.mark.parametrize(("text", "expected"), EXTRACTION)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_extraction_table_is_large():
    assert len(EXTRACTION) >= 40


MATCHES = [
    ("3.0", "3", True),
    ("1000", "1,000", True),
    ("0.5", "1/2", True),
    ("-5", "-5.00", True),
    ("1234.50", "1234.5", True),
    ("3/4", "0.75", True),
    ("$5", "5", True),
    ("5", "-5", False),
    ("72", "73", False),
    ("0.3333", "1/3", False),  # exact numbers: no rounding in answers
    ("\\sqrt{4}", "2", True),  # math-verify
    ("\\frac{1}{2}", "0.5", True),  # math-verify: one side is latex
    ("2x+3", "3+2x", True),  # math-verify: symbolic
    ("\\sqrt{2}", "2", False),
    ("abc", "3", False),
    (None, "3", False),
    ("3", None, False),
    ("", "3", False),
    ("{" * 1000, "1", False),  # garbage never raises
    ("\\frac{1}{0}", "1", False),
]


@pytest.mark.parametrize(("pred", "ref", "expected"), MATCHES)
def test_answers_match(pred, ref, expected):
    assert answers_match(pred, ref) is expected


def test_answers_match_off_the_main_thread():
    # math-verify's own timeout uses signal.alarm, which raises off the main thread; we turn it off
    out = []
    thread = threading.Thread(target=lambda: out.append(answers_match("\\sqrt{4}", "2")))
    thread.start()
    thread.join()
    assert out == [True]


def _gsm8k(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_gsm8k_reference_solutions_score_1_and_corrupted_answers_0(gsm8k_path):
    rows = _gsm8k(gsm8k_path)
    assert len(rows) == 7473
    solutions = [r["answer"] for r in rows]
    finals = [r["answer"].split("####")[-1].strip() for r in rows]
    # "1,080" + 1 -> "1081": every corrupted answer differs from the reference by exactly 1
    corrupted = [str(Fraction(f.replace(",", "")) + 1) for f in finals]
    prompts = [r["question"] for r in rows]
    assert accuracy(prompts, solutions, answer=finals) == [1.0] * len(rows)
    assert accuracy(prompts, solutions, answer=corrupted) == [0.0] * len(rows)


def test_accuracy_columns():
    completions = ["So 2 + 2 = 4.\n#### 4", "I think it is 5", "no idea", "anything"]
    answers = ["4", 4, "4", None]  # an int answer (procedural tasks) works; None -> no score
    scores = accuracy(["q"] * 4, completions, answer=answers, correct=2.0, incorrect=-1.0,
                      completion_length=[9, 9, 9, 9], truncated=[False] * 4, unknown_column=[0] * 4)
    assert scores == [2.0, -1.0, -1.0, None]


def test_accuracy_takes_a_whole_reference_solution():
    # a data loader that keeps GSM8K's full solution as `answer` still gets the final number compared
    assert accuracy(["q"], ["#### 72"], answer=["48/2 = <<48/2=24>>24\n48+24 = <<48+24=72>>72\n#### 72"]) == [1.0]


def test_format_reward():
    completions = ["work\n#### 72", "#### 1,000\n", "#### 72 is it", "72", "#### -3.5"]
    assert format_reward([""] * 5, completions) == [1.0, 1.0, 0.0, 0.0, 1.0]
    # a custom pattern and scores
    assert format_reward(["", ""], ["\\boxed{1}", "1"], pattern=r"\\boxed\{", match=0.5, miss=-0.5) == [0.5, -0.5]
    with pytest.raises(ConfigError, match="pattern"):
        format_reward([""], ["x"], pattern="(")


def test_length_penalty():
    # max_length 100, buffer 20: free up to 80, then -1 per 20 tokens over, capped at -penalty
    lengths = [50, 80, 90, 100, 101, 500]
    # 50, 80 -> 0; 90 -> -(90-80)/20 = -0.5; 100 -> -(100-80)/20 = -1; beyond 100 -> -1
    expected = [0.0, 0.0, -0.5, -1.0, -1.0, -1.0]
    assert length_penalty([""] * 6, [""] * 6, completion_length=lengths, max_length=100, buffer=20) == expected
    # penalty 2: 85 -> -(85-80)/20 * 2 = -0.5
    assert length_penalty([""], [""], completion_length=[85], max_length=100, buffer=20, penalty=2.0) == [-0.5]
    with pytest.raises(ConfigError, match="buffer"):
        length_penalty([""], [""], completion_length=[1], max_length=10, buffer=0)


def test_length_penalty_at_the_buffer_edges():
    # DAPO eq. 13 with L_max 16, L_cache 4, penalty 0.5: free up to 12, a ramp of -0.5/4 = -0.125 per token
    lengths = [12, 13, 14, 16, 17, None]
    # 12 = L_max - L_cache -> 0; 13 -> (12 - 13)/4 · 0.5 = -0.125; 14 -> -0.25; 16 = L_max -> (12 - 16)/4 · 0.5 = -0.5
    # 17 > L_max -> -0.5; no length -> no score
    expected = [0.0, -0.125, -0.25, -0.5, -0.5, None]
    assert length_penalty([""] * 6, [""] * 6, completion_length=lengths, max_length=16, buffer=4,
                          penalty=0.5) == expected
    # the whole length is the buffer: -1/4 per token from the first
    assert length_penalty([""] * 3, [""] * 3, completion_length=[0, 1, 4], max_length=4,
                          buffer=4) == [0.0, -0.25, -1.0]
    with pytest.raises(ConfigError, match="buffer"):
        length_penalty([""], [""], completion_length=[1], max_length=4, buffer=5)
