"""The reward model's ranking metrics (grpo_cli/rm/auc.py): the within-prompt AUC worked by hand, against the pooled
AUC of the same scores."""

from __future__ import annotations

import pytest

from grpo_cli import rm as T

# 4 prompts' samples, interleaved (grouping is by prompt, not by position)
SCORES = [0.9, 0.2, 0.5, 0.3, 0.5, 0.8, 0.1, 0.4, 0.7]
RIGHT = [True, True, False, False, True, False, False, False, True]
PROMPTS = ["a", "b", "a", "c", "a", "b", "a", "c", "d"]


def test_within_prompt_auc_by_hand():
    # a: right .9 .5, wrong .5 .1 -> (.9,.5) 1 + (.9,.1) 1 + (.5,.5) tie 1/2 + (.5,.1) 1 = 3.5 of 4 pairs = 0.875
    # b: right .2, wrong .8 -> 0 of 1 = 0.0;  c: two wrong, d: one right -> no pair, not counted
    # mean over the 2 prompts with both labels: (0.875 + 0.0) / 2 = 0.4375
    got = T.within_prompt_auc(SCORES, RIGHT, PROMPTS)
    assert (got.auc, got.prompts, got.total) == (0.4375, 2, 4)
    assert got.per_prompt == {"a": 0.875, "b": 0.0}  # each ranked prompt's own, c and d left out
    # pooled, the same scores rank 13.5 of the 20 (right, wrong) pairs: .9 beats all 5 wrong, .7 four, .5 three and
    # a tie, .2 one -> 0.675; b's right answer below its own wrong one is hidden among other prompts' pairs
    assert T.binary_auc(SCORES, RIGHT) == pytest.approx(0.675)


def test_no_prompt_with_both_labels_has_no_within_prompt_auc():
    # pooled there are both labels (a right, b wrong), but within each prompt only one: nothing GRPO could rank
    got = T.within_prompt_auc([0.9, 0.8, 0.1], [True, True, False], ["a", "a", "b"])
    assert (got.auc, got.prompts, got.total) == (None, 0, 2)
    assert T.binary_auc([0.9, 0.8, 0.1], [True, True, False]) == 1.0


def test_classification_metrics_carry_both_aucs():
    # labels >= 0.5 count as right, as the accuracy counts them
    m = T.classification_metrics(SCORES, [float(r) for r in RIGHT], PROMPTS)
    assert (m["auc"], m["auc_within_prompt"], m["auc_prompts"]) == (pytest.approx(0.675), 0.4375, 2)
