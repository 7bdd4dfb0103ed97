"""Iterative RL's gate (grpo_cli/iterative.py `gate`): which reward model scores an iteration, and the line saying why.

The AUC it reads is the retrained model's within-prompt AUC on the held-out rows (None when no held-out prompt's
samples hold both labels); the run that prints these lines: tests/integration/test_iterative.py.
"""

from __future__ import annotations

from grpo_cli import iterative


def test_a_held_out_set_where_no_prompt_has_both_labels_keeps_the_previous_model():
    # 8 held-out rows, but every prompt's samples are all right or all wrong: nothing shows the new model ranks
    keep, line = iterative.gate(1, "steps 3-4", None, 0.5, 8, "rm/iteration_000")
    assert keep
    assert line == ("iteration 1: no held-out prompt's samples hold both labels, so the retrained reward model has "
                    "no within-prompt AUC and rm.min_auc=0.5 cannot validate it: keeping the previous one "
                    "(rm/iteration_000) for steps 3-4")


def test_with_nothing_earlier_an_unvalidated_model_is_used_and_said():
    # iteration 0 from a new head: there is no previous model to keep
    keep, line = iterative.gate(0, "steps 1-2", None, 0.5, 8, None)
    assert not keep and line == ("iteration 0: no held-out prompt's samples hold both labels, so the retrained reward "
                                 "model has no within-prompt AUC and rm.min_auc=0.5 cannot validate it; there is no "
                                 "previous model to keep (a new head): it scores steps 1-2")


def test_the_bar_and_its_edges():
    # no held-out rows at all (rm.heldout_fraction=0): the user chose not to measure, the retrained model is used
    assert iterative.gate(1, "steps 3-4", None, 0.5, 0, "previous") == (
        False, "iteration 1: no held-out rows (rm.heldout_fraction=0), so rm.min_auc=0.5 cannot judge the retrained "
               "reward model; it scores steps 3-4")
    assert iterative.gate(1, "steps 3-4", 0.49, 0.5, 2, "previous")[0]
    assert iterative.gate(1, "steps 3-4", 0.5, 0.5, 2, "previous") == (False, None)  # the bar is >=
    keep, line = iterative.gate(1, "steps 3-4", 0.4, 0.5, 2, None)
    assert not keep and "no previous model to keep (a new head)" in line
    assert iterative.gate(1, "steps 3-4", 0.1, None, 2, "previous") == (False, None)  # no bar set: nothing to say
    assert iterative.gate(1, "steps 3-4", None, None, 2, "previous") == (False, None)
