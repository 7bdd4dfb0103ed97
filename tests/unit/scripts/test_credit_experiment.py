"""scripts/credit_experiment.py's pure parts on fake results: what a re-run still has to do, the t-interval and the
verdict rules fixed before the runs, and the calibration rule."""

from __future__ import annotations

import json

import pytest

from tests.helpers.scripts import load_script


@pytest.fixture(scope="module")
def ce():
    return load_script("credit_experiment")


def test_a_rerun_runs_only_what_is_missing(ce, tmp_path):
    assert len(ce.pending(tmp_path)) == 30 and ce.pending(tmp_path)[:3] == [("O", 100), ("P", 100), ("O+", 100)]
    ce.write_json(ce.result_path(tmp_path, "O", 100), {"accuracy": 0.3})
    ce.write_json(ce.result_path(tmp_path, "O+", 100), {"accuracy": 0.3})
    assert ce.pending(tmp_path)[:2] == [("P", 100), ("O", 101)] and len(ce.pending(tmp_path)) == 28
    # a write that was interrupted leaves its .tmp, never a result a re-run would skip
    (tmp_path / "results" / "P_s100.tmp").write_text("{")
    assert ("P", 100) in ce.pending(tmp_path)


def test_an_interrupted_pair_starts_from_nothing(ce, tmp_path):
    run, folder = tmp_path / "train" / "P_s100", tmp_path / "eval" / "P_s100"
    (run / "checkpoints" / "step_000008").mkdir(parents=True)
    folder.mkdir(parents=True)
    ce.fresh(run, folder)
    assert not run.exists() and not folder.exists()
    ce.fresh(run)   # nothing there: nothing to do


def test_t_interval_by_hand(ce):
    # diffs 0.1, 0.0, 0.2, 0.1: mean 0.1, sample sd sqrt((0 + 0.01 + 0.01 + 0) / 3) = 0.081650,
    # t(0.975, 3) = 3.182: half-width 3.182 x 0.081650 / sqrt(4) = 0.129905
    mean, low, high = ce.t_interval([0.1, 0.0, 0.2, 0.1])
    assert (mean, low, high) == pytest.approx((0.1, 0.1 - 0.129905, 0.1 + 0.129905), abs=1e-6)


def test_the_verdict_rules(ce):
    # 10 seeds, mean 0.05, sd ~0.0105 (half-width ~0.0075): lower bound > 0, 10 of 10 positive
    good = [0.04, 0.05, 0.06, 0.05, 0.04, 0.06, 0.05, 0.05, 0.04, 0.06]
    assert ce.verdict(good, p_truncated=0.03, p_truncated_step1=0.02) == "pays"
    # the truncation guard: above 5%, or more than 5 points above the step-1 share
    assert ce.verdict(good, p_truncated=0.06, p_truncated_step1=0.04) == "inconclusive"
    assert ce.verdict(good, p_truncated=0.04, p_truncated_step1=0.0) == "pays"
    # only 7 of 10 seeds positive, lower bound still > 0: not "pays"; upper bound not < 0.03: inconclusive
    seven = [0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2, -0.01, -0.01, -0.01]
    assert ce.t_interval(seven)[1] > 0 and ce.verdict(seven, 0.0, 0.0) == "inconclusive"
    # all near zero: upper bound < +0.03
    flat = [0.0, 0.01, -0.01, 0.0, 0.005, -0.005, 0.0, 0.01, -0.01, 0.0]
    assert ce.t_interval(flat)[2] < 0.03 and ce.verdict(flat, 0.0, 0.0) == "does not pay"
    # fewer seeds than planned: no verdict yet
    assert ce.verdict(good[:6], 0.0, 0.0) == "incomplete (6 of 10 seeds)"


def test_the_report_from_fake_results(ce, tmp_path):
    for i, seed in enumerate(ce.SEEDS):
        for arm, acc in (("O", 0.30), ("P", 0.35 + 0.001 * i), ("O+", 0.32)):
            # results written before the curves were kept have none: the figure draws the curves it has
            curve = {"accuracy": [acc / 2, acc], "length": [30.0, 28.0]} if seed % 2 else None
            ce.write_json(ce.result_path(tmp_path, arm, seed), {"arm": arm, "seed": seed, "accuracy": acc,
                                                                "truncated": 0.01, "curve": curve})
    ce.write_json(tmp_path / "results" / "base.json", {"accuracy": 0.1, "truncated": 0.02})
    text = ce.report(tmp_path, tmp_path / "fig" / "credit.png")
    assert "| 100 | 0.300 | 0.350 | 0.320 | +0.050 |" in text
    assert "verdict (rule fixed before the runs): **pays**" in text
    assert (tmp_path / "report.md").read_text() == text
    assert (tmp_path / "fig" / "credit.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_runs_training_curve_from_its_metrics(ce, tmp_path):
    rows = [{"step": 1, "rewards/accuracy/mean": 0.25, "completions/mean_length": 31.5},
            {"step": 2, "rewards/accuracy/mean": 0.5, "completions/mean_length": 29.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert ce.training_curve(tmp_path) == {"accuracy": [0.25, 0.5], "length": [31.5, 29.0]}


def test_the_calibration_rule(ce):
    found = {"a": {"steps": 3, "sampled_accuracy": 0.22}, "b": {"steps": 3, "sampled_accuracy": 0.33},
             "c": {"steps": 2, "sampled_accuracy": 0.30}, "d": {"steps": 4, "sampled_accuracy": 0.45}}
    assert ce.choose_task(found) == "b"        # in range, closest to 0.3; c has too few steps, d is too easy
    assert ce.choose_task({"d": found["d"]}) is None
    json.dumps(ce.CANDIDATES)                  # what calibration.json records


def test_both_arms_start_from_the_candidates_policy_at_its_temperature(ce, tmp_path, monkeypatch):
    monkeypatch.setitem(ce.WARM_STARTS, "o2", {"data": ["data.num_operands=3"], "temperature": 1.0, "seed": 900,
                                               "steps": 2})
    monkeypatch.setitem(ce.CANDIDATES, "w", {"data": ["data.num_operands=4"], "steps": 3, "temperature": 0.7,
                                             "start": "o2"})
    monkeypatch.setitem(ce.CANDIDATES, "b", {"data": ["data.num_operands=4"], "steps": 3, "temperature": 1.0,
                                             "start": "base"})
    # a finished warm start is kept: its last checkpoint is its last step and its metrics.jsonl (the trace `run`
    # compares) is there, so nothing trains here
    ckpt = tmp_path / "warm" / "o2" / "checkpoints" / "step_000002"
    ckpt.mkdir(parents=True)
    (tmp_path / "warm" / "o2" / "metrics.jsonl").write_text("")
    assert ce.arm_settings(tmp_path, "w", []) == ["data.num_operands=4", "sampler.temperature=0.7",
                                                  f"model.init_adapter={ckpt}"]
    assert ce.start_policy(tmp_path, "w", []) == [f"checkpoint={ckpt}"]    # what calibrate and the base eval load
    assert ce.arm_settings(tmp_path, "b", []) == ["data.num_operands=4", "sampler.temperature=1.0"]
    assert ce.start_policy(tmp_path, "b", []) == []                         # the base model


def test_a_warm_start_without_its_metrics_is_trained_again(ce, tmp_path, monkeypatch):
    monkeypatch.setitem(ce.WARM_STARTS, "o2", {"data": [], "temperature": 1.0, "seed": 900, "steps": 2})
    run = tmp_path / "warm" / "o2"
    (run / "checkpoints" / "step_000002").mkdir(parents=True)  # a checkpoint alone: its trace cannot be checked
    trained = []

    def grpo(*args, log):
        trained.append(args)
        (run / "checkpoints" / "step_000002").mkdir(parents=True)
        (run / "metrics.jsonl").write_text("")

    monkeypatch.setattr(ce, "grpo", grpo)
    assert ce.warm_start(tmp_path, "o2", []) == run / "checkpoints" / "step_000002"
    assert len(trained) == 1 and "trainer.seed=900" in trained[0]
    assert ce.warm_start(tmp_path, "o2", []) == run / "checkpoints" / "step_000002" and len(trained) == 1


def test_every_candidate_names_its_start(ce):
    for name, candidate in ce.CANDIDATES.items():
        assert {"data", "steps", "temperature", "start"} <= candidate.keys(), name
        assert candidate["start"] == "base" or candidate["start"] in ce.WARM_STARTS, name
    for key, warm in ce.WARM_STARTS.items():   # the warm starts train on seeds the arms never use
        assert warm["seed"] not in ce.SEEDS and warm["steps"] >= 1, key
    json.dumps(ce.WARM_STARTS)                 # what calibration.json records
