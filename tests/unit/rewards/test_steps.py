"""Step splitting and the rule-based step verifier (grpo_cli.rewards.steps)."""

from __future__ import annotations

import gc
import json
import time

import pytest

from grpo_cli.errors import ConfigError
from grpo_cli.rewards import split_steps, verify_steps
from grpo_cli.rewards.steps import check_claims, step_rewards


def test_split_steps_lines():
    text = "a\n\n  b  \nc"
    # "a" = [0, 1); blank line 2; "  b  " is chars 3..7, b at 5 -> [5, 6); "c" at 9 -> [9, 10)
    assert split_steps(text) == [(0, 1), (5, 6), (9, 10)]
    assert split_steps("") == []
    assert split_steps(" \n\t\n") == []
    assert split_steps("one line") == [(0, 8)]


def test_split_steps_pattern():
    text = "Intro.  Step 1: a\nStep 2: b"
    # matches at 8 and 18; "Intro.  " -> [0, 6) trimmed; "Step 1: a\n" -> [8, 17); "Step 2: b" -> [18, 27)
    spans = split_steps(text, r"Step \d+:")
    assert spans == [(0, 6), (8, 17), (18, 27)]
    assert [text[a:b] for a, b in spans] == ["Intro.", "Step 1: a", "Step 2: b"]
    with pytest.raises(ConfigError, match="pattern"):
        split_steps("x", "(")


SOLUTION = (
    "Tom has 3 boxes of 4 apples.\n"     # 28 chars, prose: no claim, no step
    "He has 3 * 4 = 12 apples.\n"        # ends at 28+1+25 = 54, right -> +1
    "He eats 2, so 12 - 2 = 9 remain.\n"  # ends at 54+1+32 = 87, wrong (10) -> -1
    "#### 10"                            # ends at 87+1+7 = 95, no claim: no step
)


def test_verify_steps_hand_worked_solution():
    # two claim lines, then the answer (10, right) as a step of its own that ends with the completion (95 + 1 = 96:
    # past the last character, on the EOS)
    assert verify_steps(SOLUTION, answer="10") == [(54, 1.0), (87, -1.0), (96, 1.0)]
    # a wrong final answer: the answer's step is outcome_wrong (-1)
    assert verify_steps(SOLUTION, answer="11") == [(54, 1.0), (87, -1.0), (96, -1.0)]
    # no answer: no answer step
    assert verify_steps(SOLUTION) == [(54, 1.0), (87, -1.0)]
    # truncated: it never finished, so its answer scores outcome_truncated (-2, below a wrong answer) even though its
    # last number is 10
    assert verify_steps(SOLUTION, answer="10", truncated=True)[-1] == (96, -2.0)


def test_verify_steps_options():
    scores = verify_steps(SOLUTION, answer="10", correct=2.0, wrong=-3.0, outcome_correct=10.0, outcome_wrong=-10.0)
    # right 2, wrong -3, answer 10 (the prose lines are no steps)
    assert [r for _, r in scores] == [2.0, -3.0, 10.0]
    # one step per "Step N:"; the two claims of step 1 both hold, step 2's does not
    text = "Step 1: 2 + 2 = 4, and 4 * 3 = 12. Step 2: 12 / 4 = 2."
    assert verify_steps(text, pattern=r"Step \d+:") == [(34, 1.0), (54, -1.0)]


def test_verify_steps_clip():
    # Clip (arXiv 2410.15115): a true line's +1 is capped at 0, a wrong one stays -1, the answer is not clipped
    assert verify_steps(SOLUTION, answer="10", clip=True) == [(54, 0.0), (87, -1.0), (96, 1.0)]
    # "one true unrelated line and stop" on a problem whose answer is 8: unclipped the line pays +1 and the
    # answer -1 (sum 0, a group mean's worth when the others are wrong); clipped the line earns 0, sum -1
    assert [r for _, r in verify_steps("6 + 3 = 9", answer="8")] == [1.0, -1.0]
    assert [r for _, r in verify_steps("6 + 3 = 9", answer="8", clip=True)] == [0.0, -1.0]


def test_verify_steps_blank_completion_has_no_steps():
    assert verify_steps("", answer="3") == []
    assert verify_steps("  \n ", answer="3") == []


def test_gsm8k_calculator_notes():
    assert verify_steps("Natalia sold 48/2 = <<48/2=24>>24 clips in May.") == [(47, 1.0)]
    assert verify_steps("Natalia sold 48/2 = <<48/2=25>>25 clips in May.") == [(47, -1.0)]
    # the note is right but the prose claim beside it is wrong -> the step is wrong
    assert check_claims("So 4080 + 4080 / 2 = 4000 + 2040 = <<4080+4080/2=6120>>6120") == [True, False]


CLAIMS = [
    # (step, truth of each claim it makes)
    ("3 + 4 = 7", [True]),
    ("3 + 4 = 8", [False]),
    ("So, 3 + 4 = 7, and 2*3=6.", [True, True]),
    ("3 + 4 = 7 = 8", [True, False]),  # a chain is two claims; one operator makes the run a calculation
    ("3 + 4 = 10 - 3", [True]),  # expressions on both sides
    ("-3 + 5 = 2", [True]),
    ("(2 + 3) * 4 = 20", [True]),
    ("2^10 = 1024", [True]),  # ^ is a power in prose
    ("2**10 = 1024", [True]),
    ("17 // 5 = 3 and 17 % 5 = 2", [True, True]),
    ("$1,200 x 2 = $2,400", [True]),  # $, thousands commas, x as times
    ("0.2 x 50 = $10", [True]),
    ("3 × 4 = 12", [True]),
    ("6 ÷ 2 = 3", [True]),
    ("$2,430 – ($1,250 + $850) = $330", [True]),  # an en dash as minus
    ("20% * 50 = 10", [True]),  # 20% = 0.2
    ("1/3 = 33.3%", [True]),  # 0.333.. rounds to 0.333 at the 3 decimals shown
    ("10/3 = 3.33", [True]),  # 3.333.. rounded half up to 2 decimals = 3.33
    ("10/3 = 3.34", [False]),
    ("7/2 = 3", [False]),  # a whole-number value must be exact
    ("3 / 1/4 = 12", [True]),  # "1/4" written tight after a spaced "/" is one number: 3 / 0.25
    ("12/4/3 = 1", [True]),  # all tight: Python's left-to-right (12/4)/3
    ("17/3 = 5 and 2/3 loads", [True]),  # a mixed number
    ("Week 2 = 35 + 35 = 70", [True]),  # "Week 2" is a label, not a claim 2 = 70
    # no checkable claim
    ("half of 48 = 24", []),  # reads "48 = 24": no operator, no claim
    ("3 apples + 4 = 7", []),  # the run starts with "+": it continues prose
    ("2x - 5 = 13", []),  # algebra
    ("3x-5=16", []),
    ("D3 = 2 * 322 = 644", [True]),  # "D3" is a name; "2 * 322 = 644" is still checked
    ("100/5 = 5A/5", []),  # "5A" is algebra
    ("Start at 6:00+48=6:48", []),  # a time
    ("There are 12 eggs.", []),
    ("5/0 = 3", []),  # cannot evaluate -> no claim
]


@pytest.mark.parametrize(("step", "expected"), CLAIMS)
def test_check_claims(step, expected):
    assert check_claims(step) == expected


HOSTILE = {
    "power tower": "9**9**9**9 = 1",
    "caret tower": "9^9^9^9 = 1",
    "big power": "10**1000000 = 1",
    "10,000 nested parentheses": "(" * 10_000 + "1" + ")" * 10_000 + " = 1",
    "huge number": "1" * 100_000 + " + 1 = 2",
    "long sum": "1+" * 50_000 + "1 = 50001",
    "many equals": "1+1=" * 20_000,
    "many claims": "a 1=1+0 " * 20_000,
    "nested notes": "<<" * 10_000 + "1+1=2" + ">>" * 10_000,
    "power in a note": "<<2**4096**2=1>>",
}


@pytest.mark.parametrize("text", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_input_is_fast_and_scored(text):
    verify_steps("1 + 1 = 2", answer="2")  # imports and regex compilation are not the case's time
    # CPU time of this thread, not wall time: other processes on a busy 2-core machine stretch the wall
    # clock 3-7x (seen: 354-723 ms wall for these cases) without the verifier doing more work
    # and no garbage collection of earlier tests' objects inside the measured call
    gc.collect()
    gc.disable()
    try:
        start = time.thread_time()
        scores = verify_steps(text, answer="1")
        elapsed = time.thread_time() - start
    finally:
        gc.enable()
    # 0.5 s: the longest linear cases (20,000 claims, a 50,000-term sum) take 85-139 ms of CPU on the slowest
    # machine seen (a matmul probe at 55-95 GFLOP/s), 3x less on a fast one; a quadratic scan of them, or a
    # power evaluated, takes seconds
    assert elapsed < 0.5, f"{elapsed * 1000:.0f} ms of CPU"
    # at most the one line's step (at its last character) and the answer's (with the completion)
    assert 1 <= len(scores) <= 2 and all(end in (len(text.rstrip()), len(text) + 1) and isinstance(r, float)
                                         for end, r in scores)


def test_unverifiable_claims_are_no_steps():
    # a power too large to check is no claim (no step), not a crash and not a wrong step; the answer's step remains
    assert verify_steps("9**9**9**9 = 1") == []
    assert verify_steps("9**9**9**9 = 1", answer="1") == [(15, 1.0)]  # 14 characters, the answer's step at 15
    # 10,000 + 1 + 10,000 + len(" = 1") = 20,005 characters; the answer's step at 20,006
    assert verify_steps("(" * 10_000 + "1" + ")" * 10_000 + " = 1", answer="2") == [(20_006, -1.0)]


def test_step_rewards_scorer():
    completions = ["2 + 2 = 4\n#### 4", "2 + 2 = 5\n#### 5"]
    # first: the claim line +1, then the answer step +1; second: -1, then the answer step -1 ("#### N" is no claim)
    assert step_rewards(["q", "q"], completions, answer=["4", "4"], truncated=[False, False]) == [
        [(9, 1.0), (17, 1.0)], [(9, -1.0), (17, -1.0)]]
    assert step_rewards(["q"], ["2 + 2 = 4"]) == [[(9, 1.0)]]


def test_gsm8k_reference_solutions_have_few_wrong_steps(gsm8k_path):
    """The dataset's own arithmetic checks out: its last steps all score the outcome, and a wrong
    intermediate step is a rare, real slip in the data (29 of 24,590 claim steps when written)."""
    with open(gsm8k_path) as f:
        rows = [json.loads(line) for line in f]
    steps = wrong = 0
    for row in rows:
        final = row["answer"].split("####")[-1].strip()
        scores = verify_steps(row["answer"], answer=final)
        # the last step is the answer's: outcome correct -> exactly +1
        assert scores[-1][1] == 1.0, row["answer"]
        steps += len(scores) - 1
        wrong += sum(r < 0 for _, r in scores[:-1])
    assert steps > 24_000
    assert wrong / steps < 0.002
