"""scripts/staleness_probe.py's decision rule and table, against AUCs worked by hand (the probe itself runs on the
real model only; `--smoke` checks its plumbing on the tiny one)."""

from __future__ import annotations

import pytest
import torch

from grpo_cli import rm
from tests.helpers.scripts import load_script

probe = load_script("staleness_probe")


def scores(base_a, last_a, last_c, retrained_c, mid_a=0.7) -> dict:
    m = lambda auc: {"auc": auc, "prompts": 0 if auc is None else 20, "pooled_auc": 0.9, "rows": 512,  # noqa: E731
                     "right": 200, "of_prompts": 64}
    return {"fixed_base_A": m(base_a), "fixed_mid_A": m(mid_a), "fixed_last_A": m(last_a), "fixed_last_C": m(last_c),
            "retrained_C": m(retrained_c)}


def test_staleness_needs_both_a_fall_and_a_recovery_of_a_tenth():
    # fall 0.80 - 0.65 = 0.15, recovery 0.75 - 0.62 = 0.13: both >= 0.10
    line, numbers = probe.verdict(scores(0.80, 0.65, 0.62, 0.75))
    assert line.startswith("staleness occurs") and numbers == pytest.approx({"fall": 0.15, "recovery": 0.13})
    # fall 0.05 (recovery 0.20): the fixed model still ranks the trained policy's samples
    line, _ = probe.verdict(scores(0.80, 0.75, 0.55, 0.75))
    assert line.startswith("staleness does not occur at this scale") and "untestable here" in line
    # fall 0.20, recovery 0.05: retraining does not win it back
    assert probe.verdict(scores(0.80, 0.60, 0.60, 0.65))[0].startswith("staleness does not occur at this scale")
    # the bars are inclusive: 0.70 -> 0.60 and 0.60 -> 0.70 are 0.10 each, though 0.7 - 0.6 is 0.0999... in floats
    assert probe.verdict(scores(0.70, 0.60, 0.60, 0.70))[0].startswith("staleness occurs")


def test_an_unmeasured_auc_leaves_the_verdict_undetermined():
    line, numbers = probe.verdict(scores(0.80, None, 0.62, 0.75))
    assert line == ("undetermined: no prompt with both a right and a wrong sample in fixed on step 40, set A, so the "
                    "within-prompt AUC the rule reads is not measured")
    assert numbers == {"fall": None, "recovery": None}


def test_the_table_has_a_row_per_measurement():
    s = scores(0.80, 0.65, 0.62, 0.75)
    text = probe.table(s, *probe.verdict(s))
    lines = text.splitlines()
    assert lines[2] == "| base | A (64) | 200 / 512 | fixed | 0.800 (20) | 0.900 |"
    assert lines[6] == "| step 40 | C (64) | 200 / 512 | retrained on step 40 | 0.750 (20) | 0.900 |"
    assert "fall (fixed, base → step 40, set A): 0.150; recovery (retrained − fixed, step 40, set C): 0.130." in text
    assert lines[-1].startswith("**staleness occurs")


def test_samples_become_rows_with_the_rules_label():
    # grpo sample's records: right, wrong, no answer found (wrong, as the labeler counts it), no reference (no row)
    records = [{"question": "q1", "completion": "7", "reference": "7", "correct": True},
               {"question": "q1", "completion": "8", "reference": "7", "correct": False},
               {"question": "q1", "completion": "hm", "reference": "7", "correct": None},
               {"question": "q2", "completion": "3", "reference": None, "correct": None}]
    assert [(r["prompt"], r["label"]) for r in probe.rows_of(records)] == [("q1", 1.0), ("q1", 0.0), ("q1", 0.0)]


def test_measure_reads_a_saved_reward_model_within_each_prompt(tiny, tmp_path):
    # a random head on the tiny model, saved as grpo rm saves it; q1 holds both labels, q2 only wrong answers
    base, tokenizer = tiny
    folder = rm.save_reward_model(rm.new_classifier("outcome", base, tokenizer, seed=0), tokenizer, tmp_path / "rm",
                                  {"kind": "outcome", "template": "{prompt}{completion}"})
    rows = [{"prompt": p, "completion": c, "label": y}
            for p, c, y in (("q1", "7", 1.0), ("q1", "8", 0.0), ("q1", "9", 0.0), ("q2", "1", 0.0), ("q2", "2", 0.0))]
    got = probe.measure(folder, rows)
    scores, _ = rm.predict(*rm.load_classifier(folder, "outcome", torch.device("cpu"), torch.float32),
                           rows, kind="outcome", template="{prompt}{completion}")
    # within prompt, q1 alone: its right answer above each of its 2 wrong ones counts 1, a tie 1/2; pooled: all 4
    def pairs(wrong):
        return sum(1.0 if scores[0] > s else 0.5 if scores[0] == s else 0.0 for s in wrong) / len(wrong)

    assert got == {"auc": pytest.approx(pairs(scores[1:3])), "prompts": 1,
                   "pooled_auc": pytest.approx(pairs(scores[1:])), "rows": 5, "right": 1, "of_prompts": 2,
                   "per_prompt": {"q1": pytest.approx(pairs(scores[1:3]))}}


def test_intervals_pair_the_recovery_and_not_the_fall():
    s = scores(0.80, 0.65, 0.62, 0.75)
    s["fixed_base_A"]["per_prompt"] = {"a": 0.9, "b": 0.7}        # mean 0.8, variance 0.02
    s["fixed_last_A"]["per_prompt"] = {"c": 0.6, "d": 0.8, "e": 0.7}  # mean 0.7, variance 0.01
    s["fixed_last_C"]["per_prompt"] = {"f": 0.5, "g": 0.6, "h": 0.9}
    s["retrained_C"]["per_prompt"] = {"f": 0.7, "g": 0.7, "h": 0.9, "i": 0.2}  # i: no pair
    got = probe.intervals(s)
    # fall: 0.8 - 0.7 = 0.1, se = sqrt(0.02 / 2 + 0.01 / 3) = 0.11547, t(0.975, 1 df) = 12.706 -> half 1.4672
    assert got["fall"] == pytest.approx((0.1, 0.1 - 1.46717, 0.1 + 1.46717), abs=1e-4)
    # recovery, paired on f, g, h: differences 0.2, 0.1, 0.0 -> mean 0.1, sd 0.1, half 4.303 * 0.1 / sqrt(3) = 0.24844
    assert got["recovery"] == pytest.approx((0.1, 0.1 - 0.24844, 0.1 + 0.24844), abs=1e-4)
    assert probe.intervals(scores(0.8, 0.6, 0.6, 0.7)) == {"fall": None, "recovery": None}  # no per-prompt AUCs
    assert "recovery: 95% t-interval over prompts -0.148 … +0.348" in probe.table(s, *probe.verdict(s))
