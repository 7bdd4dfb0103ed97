"""algo.dynamic_sampling through `grpo train` on the tiny model: no tie group in an update, the batch full unless
the bound was hit, exact resume; a filter metric the reward lacks stops before the model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo_cli import recipe
from grpo_cli.commands import train
from grpo_cli.errors import ConfigError
from tests.helpers.cli import run_cli
from tests.helpers.runs import TINY, deterministic, metrics, tiny_cfg

# the digit reward (1 when the completion has a digit) on the tiny random model: some groups tie, some do not
DYNAMIC = ["algo.dynamic_sampling=true", "algo.filter_metric=digit", "algo.max_generation_batches=4",
           "trainer.log_completions_every=1", "trainer.num_completions_to_print=0"]


def _completions(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]


def test_dynamic_sampling_trains_on_groups_with_signal_only_and_resumes_exactly(four_step_run, tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    off = four_step_run  # the same tiny run without dynamic sampling, every step's completions logged (conftest)
    train.run(tiny_cfg(*DYNAMIC, "trainer.max_steps=4", "trainer.save_every=2"), straight)
    records = metrics(straight)
    lines = _completions(straight)
    for r in records:
        step = [line for line in lines if line["step"] == r["step"]]
        groups: dict[int, list[float]] = {}
        for line in step:
            groups.setdefault(line["prompt_id"], []).append(line["rewards"]["digit"])
        # no update batch holds a tie group under the filter metric
        assert all(len(set(scores)) > 1 for scores in groups.values()), (r["step"], groups)
        # the batch is full (2 prompts x G = 4) unless the bound was hit, and then the metrics say so
        assert (len(groups) == 2) == (r["dynamic/batch_full"] == 1.0)
        assert r["frac_reward_zero_std"] == 0.0 and r["dynamic/generation_batches"] <= 4
        assert r["dynamic/prompts_drawn"] == 2 * r["dynamic/generation_batches"]
    # the stream went on past the extra draws: prompt ids grow across steps and never repeat within the run
    ids = [line["prompt_id"] for line in lines]
    assert len(set(ids)) == len(ids) // 4 and max(ids) >= 2 * 4
    assert any(r["dynamic/generation_batches"] > 1 for r in records)  # the filter did drop something

    # exact resume: 2 steps, then 2 more from the checkpoint, equal the 4 straight steps
    train.run(tiny_cfg(*DYNAMIC, "trainer.max_steps=2", "trainer.save_every=2"), split)
    train.run(tiny_cfg(*DYNAMIC, "trainer.max_steps=4", "trainer.save_every=2", f"resume={split}"), split)
    assert [deterministic(r) for r in metrics(split)] == [deterministic(r) for r in records]
    wa = load_file(straight / "checkpoints/step_000004/adapter_model.safetensors")
    wb = load_file(split / "checkpoints/step_000004/adapter_model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)

    # off (the default), the same run trains on tie groups too
    assert any(r["frac_reward_zero_std"] > 0 for r in metrics(off)) and "dynamic/kept_share" not in metrics(off)[0]


def test_a_filter_metric_the_reward_lacks_stops_before_the_model_loads(tmp_path, monkeypatch):
    monkeypatch.setattr(recipe, "build_policy", lambda *a: pytest.fail("the model loaded"))
    with pytest.raises(ConfigError, match=r"algo.filter_metric \(digits\) is not a function of this reward \(it "
                                          r"has: accuracy, digit\); set algo.filter_metric=accuracy"):
        train.run(tiny_cfg("algo.dynamic_sampling=true", "algo.filter_metric=digits", "trainer.max_steps=1"), tmp_path)


def test_the_console_says_when_every_group_tied(tmp_path):
    # an empty pattern matches every completion: every group ties on `always` in every draw
    tied = ("+reward.functions.always={_target_:grpo_cli.rewards.outcome.format_reward,_partial_:true,"
            "pattern:''}")
    result = run_cli(["train", *TINY, tied, "+reward.weights.always=1.0", "algo.dynamic_sampling=true",
                      "algo.filter_metric=always", "algo.max_generation_batches=2", "trainer.max_steps=1",
                      "hydra.run.dir=run"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert ("step 1: dynamic sampling: every group tied on always in 2 draws (algo.max_generation_batches=2); "
            "trained on the last draw as it is") in " ".join(result.stderr.split())
