"""scripts/iterating_at_scale.py's pure parts on fake results: the two arms' commands (one setting apart), the verdict
rule at its boundaries and the secondary endpoints against numbers worked by hand, and one (arm, seed) through a fake
`grpo` (the real runs take hours; `run -- model=tiny` checks the plumbing end to end)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.scripts import load_script


@pytest.fixture(scope="module")
def ias():
    return load_script("iterating_at_scale")


def test_the_arms_differ_in_retraining_alone(ias, tmp_path):
    model, run = tmp_path / "rm" / "model", tmp_path / "run"
    iterative = ias.train_command("iterative", 3, model, run, (4, 10, 64), ["model=tiny"])
    fixed = ias.train_command("fixed", 3, model, run, (4, 10, 64), ["model=tiny"])
    assert [a for a in iterative if a not in fixed] == ["iterative.retrain=True"]
    assert [a for a in fixed if a not in iterative] == ["iterative.retrain=False"]
    for a in ("+recipe=iterative_from_rm", f"reward.name_or_path={model}", "iterative.iterations=4",
              "iterative.steps=10", "trainer.max_steps=40", "rm.num_problems=64", "rm.samples_per_problem=8",
              "rm.min_auc=null", "trainer.seed=3",
              "trainer.guard=null", "trainer.eval_every=null", f"hydra.run.dir={run}"):
        assert a in fixed, a
    assert fixed[0] == "train" and fixed[-1] == "model=tiny"
    assert ias.SEEDS == tuple(range(8)) and (ias.ITERATIONS, ias.STEPS, ias.PROBLEMS, ias.SAMPLES) == (4, 10, 64, 8)
    assert "eval.limit=500" in ias.EVAL and "reward=arithmetic" in ias.EVAL


def spread(m: float, a: float) -> list[float]:
    """Eight per-seed differences, four at m + a and four at m - a: mean m, sample sd a·√(8/7), so the 95%
    t-interval's half-width is t(0.975, 7)·a·√(8/7)/√8 = 2.365·a/√7 = 0.893892·a."""
    return [m + a] * 4 + [m - a] * 4


def test_the_verdict_rule_at_its_boundaries(ias):
    # a = 0.03: half-width 0.893892 x 0.03 = 0.026817
    # m = 0.027: lower +0.000183 > 0: pays
    assert ias.verdict(spread(0.027, 0.03)) == "pays"
    # m = 0.026: lower -0.000817, upper 0.052817: inconclusive
    assert ias.verdict(spread(0.026, 0.03)) == "inconclusive"
    # m = 0.023: upper 0.049817 < 0.05: does not pay
    assert ias.verdict(spread(0.023, 0.03)) == "does not pay"
    # a plain loss: m = -0.05, upper -0.023: does not pay
    assert ias.verdict(spread(-0.05, 0.03)) == "does not pay"
    # fewer seeds than planned: no verdict yet
    assert ias.verdict(spread(0.1, 0.03)[:7]) == "incomplete (7 of 8 seeds): no verdict"


def fake(arm: str, seed: int, accuracy: float, auc: list, curve: list[float]) -> dict:
    """A result as run_one writes it: boundaries 0-3, the scoring model's AUC at 1-3 under the arm's key."""
    key = "rm/auc_current_policy" if arm == "iterative" else "rm/auc_current_policy_before"
    bounds = [{"iteration": 0, "step": 1, key: 0.9}]
    bounds += [{"iteration": i, "step": 1 + 2 * i, key: a} for i, a in enumerate(auc, start=1)]
    return {"arm": arm, "seed": seed, "accuracy": accuracy, "truncated": 0.0, "length": 10.0, "train_s": 1.0,
            "eval_s": 1.0, "start_rm_sha256": "x", "boundaries": bounds,
            "curve": {"accuracy": curve, "length": [1.0] * len(curve), "truncated": [0.0] * len(curve)}}


def test_the_secondary_endpoints_worked_by_hand(ias):
    # boundaries every 2 steps (iteration 1 starts at step 3), so the training endpoint is the mean of steps 3-6
    results = [
        fake("iterative", 0, 0.60, [0.8, None, 0.9], [0.0, 0.0, 0.5, 0.5, 0.7, 0.9]),
        fake("fixed", 0, 0.50, [0.7, 0.6, 0.5], [0.0, 0.0, 0.5, 0.5, 0.5, 0.5]),
        fake("iterative", 1, 0.40, [0.6, 0.6, 0.6], [0.2, 0.2, 0.2, 0.2, 0.2, 0.2]),
        fake("fixed", 1, 0.40, [0.6, 0.6, 0.6], [0.2, 0.2, 0.2, 0.2, 0.2, 0.2]),
    ]
    s = ias.summarize(results, {"accuracy": 0.3}, planned=2)
    one, two = s["rows"]
    # seed 0: d = 0.10; AUC boundaries measured in both: 1 (0.8 - 0.7) and 3 (0.9 - 0.5): mean 0.25;
    # training: (0.5 + 0.5 + 0.7 + 0.9) / 4 - 0.5 = 0.65 - 0.5 = 0.15
    assert one["d"] == pytest.approx(0.10) and one["auc_d"] == pytest.approx(0.25)
    assert one["train_d"] == pytest.approx(0.15)
    # seed 1: the arms alike in all
    assert two["d"] == 0.0 and two["auc_d"] == 0.0 and two["train_d"] == 0.0
    # primary over the two seeds: mean 0.05, sd 0.070711, half-width 12.706 x 0.070711 / √2 = 0.6353
    assert s["primary"]["mean"] == pytest.approx(0.05)
    assert s["primary"]["upper"] - s["primary"]["mean"] == pytest.approx(0.6353, abs=1e-4)
    assert s["mechanism"]["mean"] == pytest.approx(0.125) and s["training"]["mean"] == pytest.approx(0.075)
    assert s["verdict"] == "inconclusive" and s["start_models"] == 1
    # the planned figures of the docstring: half-width 2.365 x 0.065 / √8 = 0.0543, detectable 3.261 x 0.065 / √8
    # = 0.0749
    full = ias.summarize(results, None)
    assert full["planned_half"] == pytest.approx(0.0543, abs=1e-4)
    assert full["planned_detectable"] == pytest.approx(0.0749, abs=1e-4)
    assert full["verdict"] == "incomplete (2 of 8 seeds): no verdict"
    text = ias.markdown(s)
    assert "| 0 | 0.600 | 0.500 | +0.100 | 0.80, –, 0.90 / 0.70, 0.60, 0.50 | +0.150 |" in text
    assert "Base model (no adapter) 0.300" in text and "**inconclusive**" in text


def test_one_arm_and_seed_through_a_fake_grpo(ias, tmp_path, monkeypatch):
    calls = []

    def grpo(*args, log):
        calls.append(args)
        folder = Path(next(a for a in args if a.startswith("hydra.run.dir=")).split("=", 1)[1])
        if args[0] == "train":
            assert not (folder / "stale").exists()   # an interrupted run's folder was removed first
            (folder / "checkpoints" / "step_000040").mkdir(parents=True)
            row = {"rewards/accuracy/mean": 0.5, "completions/mean_length": 12.0, "completions/clipped_ratio": 0.0}
            (folder / "metrics.jsonl").write_text(json.dumps(row) + "\n")
            bound = {"iteration": 0, "step": 1, "kept_previous": False, "rm/auc_current_policy": None, "extra": 1}
            (folder / "iterations.jsonl").write_text(json.dumps(bound) + "\n")
        else:
            folder.mkdir(parents=True)
            (folder / "eval.json").write_text(json.dumps({"results": [{"accuracy": 0.5, "truncation_rate": 0.0}]}))
            rows = [{"index": 1, "correct": True}, {"index": 0, "correct": False}]
            (folder / "eval_samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return 2.0

    monkeypatch.setattr(ias, "grpo", grpo)
    (tmp_path / "train" / "fixed_s5" / "stale").mkdir(parents=True)
    result = ias.run_one(tmp_path, "fixed", 5, tmp_path / "rm" / "model", "abc", (4, 10, 64), [])
    assert [c[0] for c in calls] == ["train", "eval"]
    assert "iterative.retrain=False" in calls[0] and "eval.limit=500" in calls[1]
    assert f"checkpoint={tmp_path / 'train' / 'fixed_s5' / 'checkpoints' / 'step_000040'}" in calls[1]
    assert result["correct"] == [0, 1] and result["start_rm_sha256"] == "abc"
    assert result["boundaries"][0]["kept_previous"] is False and "extra" not in result["boundaries"][0]
    assert json.loads(ias.result_path(tmp_path, "fixed", 5).read_text()) == result
