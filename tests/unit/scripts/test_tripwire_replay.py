"""scripts/tripwire_replay.py: the guard's length tripwire replayed step by step on kept records, against a series
worked by hand, for both record formats the experiments keep."""

from __future__ import annotations

import json

import pytest

from tests.helpers.scripts import load_script


@pytest.fixture(scope="module")
def tr():
    return load_script("tripwire_replay")


def test_a_series_worked_by_hand(tr):
    # window 2. step 3: running mean (10 + 10) / 2 = 10, 16 > 1.5 x 10 = 15: fires (ratio 1.6).
    # step 4: mean length (10 + 16) / 2 = 13, 10 / 13 = 0.77; truncated mean (0 + 0) / 2 = 0, 0.5 > 0 + 0.3: fires.
    # step 5: mean length (16 + 10) / 2 = 13, 12 / 13; truncated mean (0 + 0.5) / 2 = 0.25, 0.5 < 0.55: quiet
    curve = {"length": [10.0, 10.0, 16.0, 10.0, 12.0], "truncated": [0.0, 0.0, 0.0, 0.5, 0.5]}
    got = tr.replay(tr.records({"curve": curve}), max_ratio=1.5, max_truncated_rise=0.3, window=2)
    assert got["fired"] == [3, 4]
    assert got["max_ratio"] == pytest.approx(1.6) and got["max_truncated_rise"] == pytest.approx(0.5)


def test_a_curve_without_truncated_shares_replays_the_length_half_only(tr):
    rows = tr.records({"curve": {"length": [10.0, 10.0, 14.0]}})
    got = tr.replay(rows, max_ratio=1.5, max_truncated_rise=0.3, window=2)
    assert got == {"fired": [], "max_ratio": pytest.approx(1.4), "max_truncated_rise": None}
    assert tr.records({"curve": {"accuracy": [0.5]}}) is None


def test_the_default_jobs_metrics_and_the_tables(tr, tmp_path):
    metrics = [{"step": s, "completions/mean_length": n, "completions/clipped_ratio": 0.0}
               for s, n in enumerate([20.0, 20.0, 40.0], 1)] + [{"step": 3, "eval/accuracy": 0.5}]
    (tmp_path / "async" / "results").mkdir(parents=True)
    (tmp_path / "async" / "results" / "k0_seed0.json").write_text(json.dumps({"metrics": metrics}))
    (tmp_path / "async" / "results" / "k0_seed1.json").write_text(json.dumps({"metrics": metrics[:2]}))
    limits = {"max_ratio": 1.5, "max_truncated_rise": 0.3, "window": 2}
    found = tr.replays(tmp_path, limits)
    assert tr.table(found, limits)[-2:] == ["| default job | k0_seed0 | 3 | 0.500 | 3 | 2.00 | +0.00 |",
                                            "| default job | k0_seed1 | 2 | – | none | 0.00 | +0.00 |"]
    assert tr.summary(found)[-1] == "| default job | k0 | 2 | 1 | 2.00 | +0.00 |"
    assert set(tr.thresholds()) == {"max_ratio", "max_truncated_rise", "window"}  # conf/train.yaml's, remedy aside
