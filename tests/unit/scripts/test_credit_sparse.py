"""scripts/credit_sparse.py's pure parts on fake results: the arms' commands (the base model on add3, no warm start),
the verdict rule at its boundaries, the regime x arm interaction's Welch interval and the area under the training
curve, all against numbers worked by hand, and one (arm, seed) through a fake `grpo` (the real runs take hours;
`run -- model=tiny` checks the plumbing end to end)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.scripts import load_script


@pytest.fixture(scope="module")
def cs():
    return load_script("credit_sparse")


def test_the_sparse_arms_start_from_the_base_model_on_add3(cs, tmp_path):
    for arm, recipe in (("O", "+recipe=multistep_outcome"), ("P", "+recipe=multistep_process")):
        args = cs.train_command(arm, 100, 24, tmp_path / "run", ["model=tiny"])
        assert args[:2] == ["train", recipe]
        assert not any(a.startswith("model.init_adapter") or a.startswith("checkpoint=") for a in args)
        # the dense regime's task, shaping and temperature; the seed and steps of the design; the extra override last
        for a in ("data.num_operands=4", "data.operators=[+]", "algo.overlong_buffer=16", "algo.overlong_penalty=1.0",
                  "sampler.temperature=1.0", "trainer.seed=100", "trainer.max_steps=24",
                  f"hydra.run.dir={tmp_path / 'run'}", "trainer.guard=null", "trainer.eval_every=null"):
            assert a in args, (arm, a)
        assert args[-1] == "model=tiny"
    assert not any(a.startswith("reward.scorer") for a in cs.train_command("P", 100, 24, tmp_path, []))  # not O+
    assert list(cs.ARMS) == ["O", "P"]
    # the eval: greedy, 200 held-out add3 problems, a truncated completion wrong; the base model when no checkpoint
    args = cs.eval_command(tmp_path / "ckpt", tmp_path / "eval", [])
    for a in (f"checkpoint={tmp_path / 'ckpt'}", "data=multistep", "data.num_operands=4", "data.operators=[+]",
              "eval.limit=200", "eval.num_samples=0", "reward.functions.accuracy.wrong_if_truncated=true"):
        assert a in args, a
    assert not any(a.startswith("checkpoint=") for a in cs.eval_command(None, tmp_path / "eval", []))


def test_a_rerun_runs_only_what_is_missing(cs, tmp_path):
    assert len(cs.pending(tmp_path)) == 20 and cs.pending(tmp_path)[:3] == [("O", 100), ("P", 100), ("O", 101)]
    cs.write_json(cs.result_path(tmp_path, "O", 100), {"accuracy": 0.1})
    assert cs.pending(tmp_path)[:2] == [("P", 100), ("O", 101)] and len(cs.pending(tmp_path)) == 19


def spread(m: float, a: float) -> list[float]:
    """Ten per-seed differences, five at m + a and five at m - a: mean m, sample sd a·√(10/9), so the 95%
    t-interval's half-width is t(0.975, 9)·a·√(10/9)/√10 = 2.262·a/3."""
    return [m + a] * 5 + [m - a] * 5


def test_the_verdict_rule_at_its_boundaries(cs):
    # a = 0.03: half-width 2.262 x 0.03 / 3 = 0.02262
    # m = 0.023: lower +0.00038 > 0 and P's truncation 0.10 <= O's 0.05 + 0.05: pays
    assert cs.verdict(spread(0.023, 0.03), p_truncated=0.10, o_truncated=0.05) == "pays"
    # m = 0.022: lower -0.00062, not above 0; upper 0.04462 < 0.05: does not pay
    assert cs.verdict(spread(0.022, 0.03), p_truncated=0.0, o_truncated=0.0) == "does not pay"
    # a = 0.04: half-width 2.262 x 0.04 / 3 = 0.03016
    # m = 0.0195: lower -0.01066, upper 0.04966 < 0.05: does not pay
    assert cs.verdict(spread(0.0195, 0.04), 0.0, 0.0) == "does not pay"
    # m = 0.0205: lower -0.00966, upper 0.05066: inconclusive
    assert cs.verdict(spread(0.0205, 0.04), 0.0, 0.0) == "inconclusive"
    # the truncation guard: m = 0.1, a = 0.03 (interval 0.0774 … 0.1226); P 0.1005 > O's 0.05 + 0.05: not "pays",
    # and the upper bound is not below 0.05: inconclusive
    assert cs.verdict(spread(0.1, 0.03), p_truncated=0.1005, o_truncated=0.05) == "inconclusive"
    # a tie at exactly O + 5 points: 34/200 = 0.17 against 24/200 = 0.12, where float 0.12 + 0.05 = 0.16999999999999998
    assert 0.17 > 0.12 + 0.05 and cs.verdict(spread(0.1, 0.03), p_truncated=0.17, o_truncated=0.12) == "pays"
    # a lower bound above 0 with the guard failed and the upper bound below 0.05: the rule's second clause holds
    assert cs.verdict(spread(0.023, 0.03), p_truncated=0.2, o_truncated=0.0) == "does not pay"
    # fewer seeds than planned: no verdict yet
    assert cs.verdict(spread(0.1, 0.03)[:6], 0.0, 0.0) == "incomplete (6 of 10 seeds)"


def test_the_interaction_is_a_welch_interval_worked_by_hand(cs):
    # sparse 0.1, 0.0, 0.2, 0.1: mean 0.1, variance 0.02/3 = 0.0066667; dense 0.0, 0.02, -0.02, 0.0: mean 0,
    # variance 0.0008/3 = 0.00026667. SE² = 0.0066667/4 + 0.00026667/4 = 0.0017333, SE = 0.041633;
    # df = 0.0017333² / (0.0016667²/3 + 0.000066667²/3) = 3.0044e-6 / 9.2741e-7 = 3.2396 -> t(0.975, 3) = 3.182;
    # half-width 3.182 x 0.041633 = 0.132477
    mean, low, high, df = cs.welch([0.1, 0.0, 0.2, 0.1], [0.0, 0.02, -0.02, 0.0])
    assert (mean, low, high) == pytest.approx((0.1, 0.1 - 0.132477, 0.1 + 0.132477), abs=1e-6)
    assert df == pytest.approx(3.2396, abs=1e-4)
    # one value in a regime: no interval
    assert cs.welch([0.1], [0.0, 0.02])[1:3] == (-float("inf"), float("inf"))


def test_the_area_under_the_training_curve(cs):
    # the mean of the per-step training accuracy: (0 + 0.25 + 0.5) / 3 = 0.25
    assert cs.auc({"accuracy": [0.0, 0.25, 0.5]}) == pytest.approx(0.25)
    assert cs.auc(None) is None


def fake_results(cs, out: Path, arms: dict, seeds, truncated=0.0) -> None:
    for i, seed in enumerate(seeds):
        for arm, acc in arms.items():
            acc = acc + 0.002 * i if arm == "P" else acc
            curve = {"accuracy": [acc / 2, acc], "length": [30.0, 28.0], "truncated": [0.1, 0.0]}
            cs.write_json(cs.result_path(out, arm, seed), {"arm": arm, "seed": seed, "accuracy": acc,
                                                           "truncated": truncated, "train_s": 300.0,
                                                           "eval_s": 100.0, "curve": curve})


def test_the_report_from_fake_results(cs, tmp_path):
    sparse, dense = tmp_path / "sparse", tmp_path / "dense"
    fake_results(cs, sparse, {"O": 0.10, "P": 0.20}, cs.SEEDS)
    # the dense regime also has O+ (not read) and a base.json (not a run)
    fake_results(cs, dense, {"O": 0.80, "P": 0.81, "O+": 0.5}, cs.SEEDS)
    cs.write_json(dense / "results" / "base.json", {"accuracy": 0.45, "truncated": 0.0})
    cs.write_json(sparse / "results" / "base.json", {"accuracy": 0.15, "truncated": 0.08, "eval_s": 90.0})
    text = cs.report(sparse, dense, tmp_path / "fig" / "sparse.png")
    # seed 100: O 0.100, P 0.200, d +0.100; AUC (0.05 + 0.1) / 2 = 0.075 and (0.1 + 0.2) / 2 = 0.150
    assert "| 100 | 0.100 | 0.200 | +0.100 | 0.00 / 0.00 | 0.075 / 0.150 |" in text
    # P - O: 0.100 + 0.002 x (0 + ... + 9) / 10 = 0.109; sparse - dense: 0.109 - (0.01 + 0.009) = 0.090
    assert "- P - O: +0.109" in text and "(P − O)_sparse − (P − O)_dense: +0.090" in text
    assert "verdict (rule fixed before the runs): **pays**" in text
    assert "20 runs" in text and "train 300 s" in text
    assert (sparse / "report.md").read_text() == text
    assert (tmp_path / "fig" / "sparse.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_that_ended_before_its_last_step_is_not_scored(cs, tmp_path, monkeypatch):
    # as P seed 100 did under the guard (stopped at step 13, rewound to its step-8 checkpoint): no eval, no result
    calls = []

    def grpo(*args, log):
        calls.append(args[0])
        folder = Path(next(a for a in args if a.startswith("hydra.run.dir=")).split("=", 1)[1])
        (folder / "checkpoints" / "step_000008").mkdir(parents=True)
        return 1.0

    monkeypatch.setattr(cs, "grpo", grpo)
    with pytest.raises(SystemExit, match="last checkpoint is step_000008, not step 24"):
        cs.run_one(tmp_path, "P", 100, [], 24)
    assert calls == ["train"] and not cs.result_path(tmp_path, "P", 100).exists()


def test_one_arm_and_seed_through_a_fake_grpo(cs, tmp_path, monkeypatch):
    calls = []

    def grpo(*args, log):
        calls.append(args)
        folder = Path(next(a for a in args if a.startswith("hydra.run.dir=")).split("=", 1)[1])
        if args[0] == "train":
            assert not (folder / "stale").exists()   # an interrupted run's folder was removed first
            (folder / "checkpoints" / "step_000024").mkdir(parents=True)
            rows = [{"rewards/accuracy/mean": 0.0, "completions/mean_length": 30.0, "completions/clipped_ratio": 0.1},
                    {"rewards/accuracy/mean": 0.5, "completions/mean_length": 28.0, "completions/clipped_ratio": 0.0}]
            (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        else:
            folder.mkdir(parents=True)
            (folder / "eval.json").write_text(json.dumps({"results": [{"accuracy": 0.12, "truncation_rate": 0.03}]}))
        return 1.0

    monkeypatch.setattr(cs, "grpo", grpo)
    (tmp_path / "train" / "P_s100" / "stale").mkdir(parents=True)
    result = cs.run_one(tmp_path, "P", 100, [], 24)
    assert [c[0] for c in calls] == ["train", "eval"]
    assert f"checkpoint={tmp_path / 'train' / 'P_s100' / 'checkpoints' / 'step_000024'}" in calls[1]
    assert result["accuracy"] == 0.12 and result["truncated"] == 0.03
    assert result["curve"] == {"accuracy": [0.0, 0.5], "length": [30.0, 28.0], "truncated": [0.1, 0.0]}
    assert json.loads(cs.result_path(tmp_path, "P", 100).read_text()) == result
    assert ("P", 100) not in cs.pending(tmp_path)
