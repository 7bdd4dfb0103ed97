"""The completions log (`trainer.log_completions_every`): completions.jsonl holds every completion of
the logged steps and agrees with metrics.jsonl; a table of a few goes to the console; the file is
size-bounded and a resumed run continues it exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_cli import recipe
from grpo_cli.commands import train
from grpo_cli.config import compose
from grpo_cli.data import PromptStream
from grpo_cli.errors import ConfigError
from grpo_cli.instantiate import build
from grpo_cli.metrics.stats import mean

# the digit reward gives the tiny model's random text mixed rewards in a group (nonzero advantages)
TINY = ["+reward.functions.digit={_target_:grpo_cli.rewards.outcome.format_reward,_partial_:true,pattern:'[0-9]'}",
        "+reward.weights.digit=1.0", "model=tiny", "sampler.max_new_tokens=8", "algo.group_size=4",
        "trainer.prompts_per_step=2", "trainer.micro_batch_size=4", "optimizer.lr=0.05", "trainer.warmup_steps=0",
        "trainer.report_to=[]", "trainer.eval_every=null"]


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_completions_match_the_metrics_of_their_step(tmp_path, capsys):
    cfg = compose("train", [*TINY, "trainer.max_steps=2", "trainer.log_completions_every=1"])
    train.run(cfg, tmp_path)
    lines, records = read(tmp_path / "completions.jsonl"), read(tmp_path / "metrics.jsonl")
    assert [line["step"] for line in lines] == [1] * 8 + [2] * 8  # 2 prompts x G=4, every step
    stream = PromptStream(build(cfg.data).train, cfg.trainer.seed)
    for record in records:
        step = [line for line in lines if line["step"] == record["step"]]
        assert mean(line["reward"] for line in step) == pytest.approx(record["reward"])
        assert mean(line["rewards"]["digit"] for line in step) == pytest.approx(record["rewards/digit/mean"])
        assert mean(line["length"] for line in step) == pytest.approx(record["completions/mean_length"])
        assert mean(line["truncated"] for line in step) == pytest.approx(record["completions/clipped_ratio"])
        # prompt_id is the prompt's position in the seeded stream: step s drew positions 2(s-1), 2(s-1)+1
        first = 2 * (record["step"] - 1)
        assert [line["prompt_id"] for line in step] == [first] * 4 + [first + 1] * 4
        for line in step:
            assert line["question"] == stream[line["prompt_id"]]["question"]
        # outcome advantages are (r - group mean) / group std: they sum to 0 in each group and have the
        # sign of r - mean (the digit reward is 0/1, so some groups are mixed)
        for group in (step[:4], step[4:]):
            rewards = [line["reward"] for line in group]
            assert sum(line["advantage"] for line in group) == pytest.approx(0, abs=1e-5)
            for line in group:
                assert (line["advantage"] > 0) == (line["reward"] > mean(rewards))
    assert any(line["advantage"] != 0 for line in lines)
    err = capsys.readouterr().err
    assert "step 1: 4 of 8 completions (all in completions.jsonl)" in err and "advantage" in err


def test_only_every_nth_step_is_logged_and_the_file_is_bounded(tmp_path, capsys):
    train.run(compose("train", [*TINY, "trainer.max_steps=3", "trainer.log_completions_every=2"]), tmp_path / "a")
    assert {line["step"] for line in read(tmp_path / "a" / "completions.jsonl")} == {2}

    # 1e-4 MB = 104 bytes: the first step's 8 lines go in, the file is then full and stays so
    train.run(compose("train", [*TINY, "trainer.max_steps=3", "trainer.log_completions_every=1",
                                "trainer.completions_max_mb=1e-4", "trainer.num_completions_to_print=0"]),
              tmp_path / "b")
    assert {line["step"] for line in read(tmp_path / "b" / "completions.jsonl")} == {1}
    err = capsys.readouterr().err
    assert err.count("reached trainer.completions_max_mb") == 1
    assert "completions (all in" not in err.split("reached trainer.completions_max_mb")[1]  # rows=0: no tables


def test_process_rewards_log_their_steps(tmp_path, capsys):
    # as in test_train: newline-free random text is split into 3-character steps by the rule verifier
    train.run(compose("train", [o for o in TINY if "digit" not in o] + [
        "reward=gsm8k_process", "trainer.max_steps=1", "sampler.max_new_tokens=12",
        "reward.scorer.pattern='(?s).{3}'", "trainer.log_completions_every=1"]), tmp_path)
    lines = read(tmp_path / "completions.jsonl")
    assert any(line["steps"] for line in lines)
    for line in lines:
        ends = [end for end, _ in line["steps"]]
        # len + 1: a step that ends with the completion (the answer's)
        assert ends == sorted(ends) and all(0 < end <= len(line["completion"]) + 1 for end in ends)
        if line["steps"]:  # per_function["steps"] is the completion's mean step reward
            assert line["rewards"]["steps"] == pytest.approx(mean(r for _, r in line["steps"]))
    assert " [+" in capsys.readouterr().err or all(r <= 0 for line in lines for _, r in line["steps"])


def test_resume_continues_the_file_exactly(four_step_run, tmp_path):
    # the straight run: conftest's 4 steps of these TINY settings, every step's completions logged
    every = ["trainer.log_completions_every=1", "trainer.save_every=2"]
    train.run(compose("train", [*TINY, *every, "trainer.max_steps=3"]), tmp_path / "split")
    assert {line["step"] for line in read(tmp_path / "split" / "completions.jsonl")} == {1, 2, 3}
    # resuming from step 2 drops step 3's lines, then writes steps 3 and 4 again
    step2 = tmp_path / "split" / "checkpoints" / "step_000002"
    train.run(compose("train", [*TINY, *every, "trainer.max_steps=4", f"resume={step2}"]), tmp_path / "other")
    assert read(tmp_path / "split" / "completions.jsonl") == read(four_step_run / "completions.jsonl")


@pytest.mark.parametrize("override, message", [
    ("trainer.log_completions_every=0", "trainer.log_completions_every (0) must be an integer >= 1 or null"),
    ("trainer.num_completions_to_print=-1", "trainer.num_completions_to_print (-1) must be an integer >= 0"),
    ("trainer.completions_max_mb=0", "trainer.completions_max_mb (0) must be > 0"),
])
def test_bad_settings_stop_before_the_model_loads(tmp_path, monkeypatch, override, message):
    monkeypatch.setattr(recipe, "build_policy", lambda *_: pytest.fail("the model was loaded"))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        train.run(compose("train", [*TINY, override]), tmp_path)
