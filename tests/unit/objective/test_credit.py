"""reward.credit: how a token's advantage gathers the normalized step rewards after it. `sum` is DeepSeekMath's
(§4.1.3), `min` PURE's min-form (arXiv 2504.15275); worked by hand and against a plain loop."""

from __future__ import annotations

import random

import pytest

from grpo_cli.objective import process_advantages


def test_min_form_by_hand():
    # one group of 2, length 4. Row 0: steps +1 (token 0), -1 (token 1), +1 (token 3): a wrong step, then a lucky
    # answer. Row 1: steps +1 (token 1), +1 (token 3).
    # 5 step rewards, four +1 and one -1: mean 0.6, population std sqrt(1 - 0.36) = 0.8 (+ eps 1e-4: 0.8001)
    #   normalized +1 -> 0.4 / 0.8001 = 0.499938, -1 -> -1.6 / 0.8001 = -1.999750
    # sum: row 0 token 0: 0.499938 - 1.999750 + 0.499938 = -0.999875; token 1: -1.499813; token 2, 3: 0.499938
    # min: row 0 tokens 0, 1: min(..., -1.999750, 0.499938) = -1.999750 (the wrong step caps every token before
    #   it: the answer after it cannot pay for it); tokens 2, 3: 0.499938. Row 1: tokens 0-3 all 0.499938
    up, down = 0.4 / 0.8001, -1.6 / 0.8001
    rewards, ends = [[1.0, -1.0, 1.0], [1.0, 1.0]], [[0, 1, 3], [1, 3]]
    summed = process_advantages(rewards, ends, group_size=2, length=4, credit="sum")
    least = process_advantages(rewards, ends, group_size=2, length=4, credit="min")
    assert summed[0].tolist() == pytest.approx([2 * up + down, up + down, up, up], abs=1e-6)
    assert least[0].tolist() == pytest.approx([down, down, up, up], abs=1e-6)
    assert least[1].tolist() == pytest.approx([up] * 4, abs=1e-6)
    # past the last step: 0 in both forms
    past = process_advantages([[1.0], [-1.0]], [[1], [1]], group_size=2, length=3, credit="min")
    assert past[:, 2].tolist() == [0.0, 0.0]


def test_min_form_leaves_a_step_without_a_score_out():
    # row 0: steps +1 (token 0), NaN (token 1); row 1: -1 (token 0). Scored: +1, -1 -> ±1/(1 + 1e-4). The NaN step is
    # no candidate for the minimum: row 0 token 0 is +0.9999, token 1 (only the NaN step after it) is 0
    adv = process_advantages([[1.0, float("nan")], [-1.0]], [[0, 1], [0]], group_size=2, length=2, credit="min")
    assert adv.flatten().tolist() == pytest.approx([1 / 1.0001, 0.0, -1 / 1.0001, 0.0], abs=1e-6)


def loop_min(rewards, ends, group_size, length, eps=1e-4):
    """The min-form written out: normalize per group, then for each token the least step ending at or after it."""
    out = []
    for g in range(0, len(rewards), group_size):
        flat = [r for row in rewards[g:g + group_size] for r in row]
        mean = sum(flat) / len(flat) if flat else 0.0
        std = (sum((r - mean) ** 2 for r in flat) / len(flat)) ** 0.5 if flat else 0.0
        for row_r, row_e in zip(rewards[g:g + group_size], ends[g:g + group_size]):
            norm = [(r - mean) / (std + eps) for r in row_r]
            out.append([min([v for v, e in zip(norm, row_e) if e >= t], default=0.0) for t in range(length)])
    return out


@pytest.mark.parametrize("seed", range(10))
def test_min_form_matches_the_loop(seed):
    rng = random.Random(seed)
    group_size, length = rng.randint(1, 4), rng.randint(1, 7)
    n = group_size * rng.randint(1, 3)
    ends = [sorted(rng.randrange(length) for _ in range(rng.randint(0, 4))) for _ in range(n)]
    rewards = [[rng.choice([-1.0, 0.0, 1.0, 2.5]) for _ in row] for row in ends]
    got = process_advantages(rewards, ends, group_size, length, credit="min")
    expected = loop_min(rewards, ends, group_size, length)
    assert got.flatten().tolist() == pytest.approx([v for row in expected for v in row], abs=1e-5)


def test_an_unknown_credit_names_the_choices():
    with pytest.raises(ValueError, match="credit"):
        process_advantages([[1.0]], [[0]], 1, 1, credit="mean")
