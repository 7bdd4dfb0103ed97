"""grpo eval and grpo sample on the tiny model; pass@k and maj@k against hand-made cases."""

from __future__ import annotations

import itertools
import json
import math

import pytest

from grpo_cli.commands import evaluate, sample
from grpo_cli.config import compose
from grpo_cli.errors import ConfigError
from tests.helpers import EVAL_TINY


def brute_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of all k-subsets of n samples (c correct) that hold at least one correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n,c,k", [(n, c, k) for n in range(1, 7) for c in range(n + 1) for k in range(1, n + 1)])
def test_pass_at_k_equals_enumeration(n, c, k):
    assert evaluate.pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_large_n_is_finite():
    # C(1000, 500) overflows a float; the product form does not: 1 - C(900,10)/C(1000,10)
    expected = 1 - math.comb(900, 10) / math.comb(1000, 10)
    assert evaluate.pass_at_k(1000, 100, 10) == pytest.approx(expected, rel=1e-9)


def test_majority_vote():
    # "7" twice beats "5" once; None votes are ignored
    assert evaluate.majority_correct(["7", "5", "7", None], "7")
    assert not evaluate.majority_correct(["5", "5", "7"], "7")
    # "7.0" and "7" are different strings, so 2 votes each; ties go to the first seen ("7.0" = 7: correct)
    assert evaluate.majority_correct(["7.0", "3", "3", "7.0"], "7")
    assert not evaluate.majority_correct([None, None], "7")


def test_eval_of_a_run_writes_consistent_files(eval_run, tmp_path):
    cfg = compose("eval", [*EVAL_TINY, f"checkpoint={eval_run}", "eval.include_base=true", "eval.limit=5",
                           "eval.num_samples=3", "eval.k=[1,2]", "eval.batch_size=2"])
    report = evaluate.run(cfg, tmp_path, [f"checkpoint={eval_run}"])
    saved = json.loads((tmp_path / "eval.json").read_text())
    assert saved["results"] == json.loads(json.dumps(report["results"]))
    assert [r["step"] for r in saved["results"]] == [None, 1, 2]  # base first, then checkpoints in step order
    assert saved["results"][0]["checkpoint"] is None
    rows = [json.loads(line) for line in (tmp_path / "eval_samples.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * 5  # 3 models x 5 problems
    for result in saved["results"]:
        mine = [r for r in rows if r["checkpoint"] == result["checkpoint"]]
        assert result["num_problems"] == len(mine) == 5
        assert result["accuracy"] == pytest.approx(sum(r["correct"] for r in mine) / 5)
        assert all(len(r["samples"]) == 3 for r in mine)
        assert set(result["pass@k"]) == {"1", "2"} and set(result["maj@k"]) == {"1", "2"}
    assert (tmp_path / "accuracy.png").stat().st_size > 0
    assert saved["config"]["model"]["name"] == "tiny-random-llama"

    # a rerun in the same folder reuses every written problem and gives the same numbers
    again = evaluate.run(cfg, tmp_path, [f"checkpoint={eval_run}"])
    assert len((tmp_path / "eval_samples.jsonl").read_text().splitlines()) == 15
    assert again["results"] == report["results"]


def test_eval_is_deterministic(eval_run, tmp_path):
    cfg = compose("eval", [*EVAL_TINY, f"checkpoint={eval_run}/checkpoints/step_000002", "eval.limit=4",
                           "eval.num_samples=2", "eval.k=[1]"])
    a = evaluate.run(cfg, tmp_path / "a", [])
    b = evaluate.run(cfg, tmp_path / "b", [])
    assert a["results"][0]["pass@k"] == b["results"][0]["pass@k"]
    assert (tmp_path / "a/eval_samples.jsonl").read_text() == (tmp_path / "b/eval_samples.jsonl").read_text()


def test_eval_refuses_a_different_base_model(eval_run, tmp_path):
    cfg = compose("eval", [f"checkpoint={eval_run}", "model=smollm2_135m"])
    with pytest.raises(ConfigError, match="trained on 'tiny-random-llama'"):
        evaluate.run(cfg, tmp_path, [f"checkpoint={eval_run}", "model=smollm2_135m"])


def test_eval_k_above_num_samples_is_a_config_error(eval_run, tmp_path):
    cfg = compose("eval", [*EVAL_TINY, f"checkpoint={eval_run}", "eval.num_samples=2", "eval.k=[4]"])
    with pytest.raises(ConfigError, match="eval.num_samples=4"):
        evaluate.run(cfg, tmp_path, [])


def test_sample_prints_and_writes(eval_run, tmp_path):
    out = tmp_path / "samples.jsonl"
    cfg = compose("sample", [*EVAL_TINY, f"checkpoint={eval_run}", "sample.n=3", f"sample.output={out}",
                             "reward=gsm8k_process"])
    records = sample.run(cfg, ["reward=gsm8k_process"])  # a group override beats the checkpoint's reward
    assert len(records) == 2 * 3  # sample.num_prompts problems x n
    assert [json.loads(line) for line in out.read_text().splitlines()] == json.loads(json.dumps(records))
    assert all(r["steps"] is not None for r in records)  # process rewards: per-step scores for highlighting

    cfg = compose("sample", [*EVAL_TINY, "sample.prompt='What is 2+3?'", "sample.n=2"])
    records = sample.run(cfg, [])
    assert len(records) == 2 and records[0]["reward"] is None and records[0]["question"] == "What is 2+3?"
