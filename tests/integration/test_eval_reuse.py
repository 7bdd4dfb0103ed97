"""`grpo eval` reuses the rows of an earlier eval only when they were made with the same settings and weights; any
other rows move aside whole, and a row cut short by a kill is recomputed."""

from __future__ import annotations

import shutil

import pytest
from safetensors.torch import load_file, save_file

from grpo_cli.commands import evaluate
from tests.helpers.runs import eval_cfg, eval_rows, snapshot


def test_rerun_with_the_same_settings_reuses_every_row(eval_run, tmp_path):
    cfg = eval_cfg(f"checkpoint={eval_run}", "eval.limit=3", "eval.include_base=true")
    first = evaluate.run(cfg, tmp_path, [])
    written = (tmp_path / "eval_samples.jsonl").read_bytes()
    assert len(eval_rows(tmp_path)) == 3 * 3 and all(len(r["digest"]) == 16 for r in eval_rows(tmp_path))
    again = evaluate.run(cfg, tmp_path, [])
    assert (tmp_path / "eval_samples.jsonl").read_bytes() == written and again["results"] == first["results"]
    # a larger eval.limit keeps the 9 rows and adds problem 3 for each of the 3 models
    evaluate.run(eval_cfg(f"checkpoint={eval_run}", "eval.limit=4", "eval.include_base=true"), tmp_path, [])
    assert (tmp_path / "eval_samples.jsonl").read_bytes().startswith(written) and len(eval_rows(tmp_path)) == 12
    assert not list(tmp_path.glob("stale-*"))


@pytest.mark.parametrize("override", ["data.seed=1", "eval.max_new_tokens=2", "sampler.top_k=3",
                                      "reward.functions.accuracy.correct=2.0", "eval.batch_size=1"])
def test_rerun_with_other_settings_recomputes(eval_run, tmp_path, override):
    ckpt = f"checkpoint={eval_run}/checkpoints/step_000002"
    evaluate.run(eval_cfg(ckpt, "eval.limit=3"), tmp_path, [])
    old = snapshot(tmp_path)
    old_rows = eval_rows(tmp_path)
    report = evaluate.run(eval_cfg(ckpt, "eval.limit=3", override), tmp_path, [override])
    new_rows = eval_rows(tmp_path)
    assert len(new_rows) == 3 and {r["digest"] for r in new_rows}.isdisjoint(r["digest"] for r in old_rows)
    # the old files moved aside whole, byte for byte
    [aside] = tmp_path.glob("stale-*")
    assert snapshot(aside) == {k: v for k, v in old.items() if k in ("eval_samples.jsonl", "eval.json")}
    # what eval.json reports comes from the new rows
    assert report["results"][0]["accuracy"] == pytest.approx(sum(r["correct"] for r in new_rows) / 3)
    if override == "data.seed=1":  # other held-out problems
        assert [r["question"] for r in new_rows] != [r["question"] for r in old_rows]
    if override == "eval.max_new_tokens=2":
        assert max(r["greedy"]["length"] for r in new_rows) <= 2 < max(r["greedy"]["length"] for r in old_rows)
    if override.startswith("reward."):
        assert {r["greedy"]["reward"] for r in new_rows} <= {0.0, 2.0}


def test_retrained_weights_under_the_same_path_are_recomputed(eval_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(eval_run, run)
    cfg = eval_cfg(f"checkpoint={run}/checkpoints/step_000002", "eval.limit=2")
    evaluate.run(cfg, tmp_path / "out", [])
    adapter = run / "checkpoints" / "step_000002" / "adapter_model.safetensors"
    save_file({k: v + 0.5 for k, v in load_file(adapter).items()}, adapter)
    evaluate.run(cfg, tmp_path / "out", [])
    assert len(list((tmp_path / "out").glob("stale-*"))) == 1 and len(eval_rows(tmp_path / "out")) == 2


def test_a_line_cut_short_by_a_kill_is_recomputed(eval_run, tmp_path):
    cfg = eval_cfg(f"checkpoint={eval_run}/checkpoints/step_000002", "eval.limit=3")
    evaluate.run(cfg, tmp_path, [])
    whole = eval_rows(tmp_path)
    text = (tmp_path / "eval_samples.jsonl").read_text()
    (tmp_path / "eval_samples.jsonl").write_text(text[: len(text) - 40])  # the last row loses its end
    evaluate.run(cfg, tmp_path, [])
    # rows 0 and 1 reused as they were, row 2 recomputed (deterministic: the same values)
    assert eval_rows(tmp_path) == whole and len(list(tmp_path.glob("stale-*"))) == 1
