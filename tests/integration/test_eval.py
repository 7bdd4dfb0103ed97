"""grpo eval and grpo sample on the tiny model (pass@k and maj@k: tests/unit/test_evaluation.py)."""

from __future__ import annotations

import json

import pytest

from grpo_cli.commands import evaluate, sample
from grpo_cli.config import compose
from grpo_cli.errors import ConfigError
from tests.helpers.runs import EVAL_TINY


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
