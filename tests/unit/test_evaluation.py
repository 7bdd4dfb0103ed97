"""grpo_cli.evaluation: pass@k and maj@k against hand-made cases, and which held-out problems an in-run eval scores."""

from __future__ import annotations

import itertools
import math

import pytest

from grpo_cli import evaluation


def brute_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of all k-subsets of n samples (c correct) that hold at least one correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n,c,k", [(n, c, k) for n in range(1, 7) for c in range(n + 1) for k in range(1, n + 1)])
def test_pass_at_k_equals_enumeration(n, c, k):
    assert evaluation.pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_large_n_is_finite():
    # C(1000, 500) overflows a float; the product form does not: 1 - C(900,10)/C(1000,10)
    expected = 1 - math.comb(900, 10) / math.comb(1000, 10)
    assert evaluation.pass_at_k(1000, 100, 10) == pytest.approx(expected, rel=1e-9)


def test_majority_vote():
    # "7" twice beats "5" once; None votes are ignored
    assert evaluation.majority_correct(["7", "5", "7", None], "7")
    assert not evaluation.majority_correct(["5", "5", "7"], "7")
    # "7.0" and "7" are different strings, so 2 votes each; ties go to the first seen ("7.0" = 7: correct)
    assert evaluation.majority_correct(["7.0", "3", "3", "7.0"], "7")
    assert not evaluation.majority_correct([None, None], "7")
