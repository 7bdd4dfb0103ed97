"""Held-out eval inside `grpo train` (trainer.eval_every) on the tiny model: its record, console line and checkpoint,
its numbers equal to `grpo eval`'s on the same checkpoint, problems and engine, no number of training changed, and
bad settings refused before the model loads."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from grpo_cli import recipe
from grpo_cli.commands import evaluate, train
from grpo_cli.config import compose, validate
from grpo_cli.errors import ConfigError
from tests.helpers.cli import one_line_error, run_cli
from tests.helpers.runs import TINY, deterministic, metrics, tiny_cfg

# 2 steps, an eval after each on the first 8 held-out problems (TINY's arithmetic: 500 held out), a checkpoint
# only at the last step unless an eval writes one
EVAL = ["trainer.max_steps=2", "trainer.eval_every=1", "trainer.eval_size=8", "trainer.save_every=2"]
KEYS = {"eval/accuracy", "eval/accuracy_low", "eval/accuracy_high", "eval/reward", "eval/mean_length"}


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """(run folder, console text) of one 2-step tiny run with an eval at each step, through the command."""
    folder = tmp_path_factory.mktemp("evaluated") / "run"
    out = run_cli(["train", *TINY, *EVAL, f"hydra.run.dir={folder}"])
    assert out.returncode == 0, out.stderr[-3000:]
    return folder, out.stdout + out.stderr


def test_each_eval_is_in_its_steps_record_its_console_line_and_a_checkpoint(evaluated):
    folder, console = evaluated
    for record in metrics(folder):
        assert KEYS <= record.keys(), record.keys()
        assert record["eval/accuracy_low"] <= record["eval/accuracy"] <= record["eval/accuracy_high"]
    for step in (1, 2):
        assert re.search(rf"step {step}: held-out accuracy \d\.\d{{3}} \(\d\.\d\d-\d\.\d\d, 8 problems\), "
                         rf"reward -?\d\.\d\d, length \d+", console), console[-2000:]
    # step 1's eval wrote step 1's checkpoint (save_every=2 alone would not), and recorded it as the best so far
    assert (folder / "checkpoints" / "step_000001" / "adapter_model.safetensors").is_file()
    assert json.loads((folder / "best.json").read_text())["step"] in (1, 2)


def test_the_in_run_numbers_are_grpo_evals_on_the_same_checkpoint_problems_and_engine(evaluated, tmp_path):
    folder, _ = evaluated
    # grpo eval of the run's checkpoints (steps 1 and 2) on the same 8 problems; the run's saved sampler (HF generate,
    # 8 new tokens) and reward (arithmetic + the digit function) are inherited
    report = evaluate.run(compose("eval", ["model=tiny", f"checkpoint={folder}", "eval.limit=8"]), tmp_path,
                          [f"checkpoint={folder}", "eval.limit=8"])
    theirs = [(r["step"], r["num_problems"], r["accuracy"], r["mean_reward"], r["mean_length"])
              for r in report["results"]]
    ours = [(r["step"], 8, r["eval/accuracy"], r["eval/reward"], r["eval/mean_length"]) for r in metrics(folder)]
    assert ours == theirs
    # each eval's rows are kept, one line a problem in the split's order: grpo eval's rows, for a paired comparison
    # of two runs problem by problem
    for step, result in zip((1, 2), report["results"]):
        rows = [json.loads(line) for line in (folder / "evals" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        assert [r["index"] for r in rows] == list(range(8))
        assert sum(r["correct"] for r in rows) / 8 == result["accuracy"]
    # the two steps' weights score differently (the random model learns the digit reward), so each eval read its own
    assert ours[0][3] != ours[1][3]


def test_evals_change_no_number_of_training(evaluated, four_step_run):
    folder, _ = evaluated  # the same TINY run as four_step_run's first 2 steps, with an eval after each
    without = [deterministic(r) for r in metrics(four_step_run)[:2]]
    with_evals = [{k: v for k, v in deterministic(r).items() if not k.startswith("eval/")} for r in metrics(folder)]
    assert with_evals == without
    a = load_file(folder / "checkpoints/step_000002/adapter_model.safetensors")
    b = load_file(four_step_run / "checkpoints/step_000002/adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("override, key", [
    ("trainer.eval_every=0", "trainer.eval_every"), ("trainer.eval_every=2.5", "trainer.eval_every"),
    ("trainer.eval_size=0", "trainer.eval_size"), ("trainer.eval_size=null", "trainer.eval_size"),
])
def test_eval_settings_that_are_not_integers_of_at_least_1_are_one_line(override, key):
    with pytest.raises(ConfigError) as err:
        validate(tiny_cfg("trainer.eval_every=10", override), *train.CHECKS)
    (line,) = str(err.value).splitlines()
    assert line.startswith(f"{key} (") and f"; set {key}=" in line


def test_an_eval_size_past_the_held_out_split_is_one_line_before_the_model_loads(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(recipe, "build_policy", refuse)
    out = run_cli(["train", *TINY, "trainer.eval_every=1", "trainer.eval_size=30", "data.heldout_size=20",
                   f"hydra.run.dir={tmp_path / 'run'}"])
    assert one_line_error(out) == ("error: trainer.eval_size (30) is larger than the data's held-out split (20 "
                                   "problems); set trainer.eval_size=20 (or auto), or hold out more "
                                   "(data.heldout_size)")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
