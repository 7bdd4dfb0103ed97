"""scripts/staleness_matched.py's threshold, against paired AUC differences worked by hand (the probe itself runs on
the real model only; `--smoke` checks its plumbing on the tiny one)."""

from __future__ import annotations

import pytest

from tests.helpers.scripts import load_script

matched = load_script("staleness_matched")


def per_prompt(*aucs: float, extra: dict | None = None) -> dict:
    return {"auc": 0.0, "prompts": len(aucs), "pooled_auc": 0.0, "rows": 0, "right": 0, "of_prompts": 0,
            "per_prompt": {f"p{i}": a for i, a in enumerate(aucs)} | (extra or {})}


def test_a_gain_of_a_tenth_on_every_prompt_clears_the_threshold():
    # d = 0.1 on each of 4 prompts: mean 0.1, sd 0, so the interval is 0.1 … 0.1
    line, n = matched.verdict(per_prompt(0.9, 0.8, 1.0, 0.7), per_prompt(0.8, 0.7, 0.9, 0.6))
    assert line.startswith("staleness shows") and "worth running" in line
    assert (n["prompts"], n["mean"], n["lower"], n["upper"]) == (4, pytest.approx(0.1), pytest.approx(0.1),
                                                                  pytest.approx(0.1))


def test_a_mean_at_the_threshold_with_a_spread_that_reaches_zero_is_undetermined():
    # d = 0.1, -0.1, 0.2, 0.0: mean 0.05; sd = √((0.05² + 0.15² + 0.15² + 0.05²) / 3) = √(0.05 / 3) = 0.12910;
    # SE = 0.12910 / 2 = 0.064550; t(0.975, 3) = 3.182: 0.05 ± 0.20540 = −0.1554 … 0.2554;
    # detectable = (3.182 + 0.842) x 0.064550 = 0.25975
    line, n = matched.verdict(per_prompt(0.6, 0.5, 0.9, 0.7), per_prompt(0.5, 0.6, 0.7, 0.7))
    assert line.startswith("undetermined at this scale") and "not run" in line
    assert n["mean"] == pytest.approx(0.05)
    assert (n["lower"], n["upper"]) == (pytest.approx(-0.1554, abs=1e-4), pytest.approx(0.2554, abs=1e-4))
    assert n["detectable"] == pytest.approx(0.25975, abs=1e-4)
    assert "detects 0.260 with 80% power" in line


def test_the_threshold_is_inclusive_and_only_shared_prompts_are_paired():
    # d = 0.04, 0.06, 0.05, 0.05: mean 0.05 (the bar, inclusive); sd = √(0.0002 / 3) = 0.0081650, SE 0.0040825,
    # half-width 3.182 x 0.0040825 = 0.012990: lower 0.0370 > 0. The prompt only the matched model has (no right
    # and wrong sample under the other's scores cannot happen on one set of samples, but a key it lacks) is left out.
    line, n = matched.verdict(per_prompt(0.94, 0.76, 0.55, 0.85), per_prompt(0.90, 0.70, 0.50, 0.80, extra={"x": 0.1}))
    assert n["prompts"] == 4 and n["lower"] == pytest.approx(0.0370, abs=1e-4)
    assert line.startswith("staleness shows")


def test_fewer_than_two_paired_prompts_leave_it_undetermined():
    line, n = matched.verdict(per_prompt(0.9), per_prompt(0.5))
    assert line.startswith("undetermined: fewer than 2 prompts") and n == {"prompts": 1}
