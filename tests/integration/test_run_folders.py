"""A command's run folder never lies inside a training run's folder (a run's keep_last would delete it, Hydra
would rewrite its records): refused in one line before Hydra writes, and no file of the run changes."""

from __future__ import annotations

import pytest

from grpo_cli.commands import train
from grpo_cli.errors import ConfigError
from tests.helpers.cli import one_line_error, run_cli
from tests.helpers.runs import TINY, copy_run, digests, tiny_cfg


# each case runs the command in-process (under a second), so every command is in the fast suite
@pytest.mark.parametrize("command", ["train", "eval", "sample", "export"])
def test_a_folder_inside_a_run_is_refused_before_hydra_writes(trained_run, tmp_path, command):
    run = copy_run(trained_run, tmp_path / "run")
    before = digests(run)
    inside = run / "checkpoints" / "step_000002" if command == "train" else run / "checkpoints" / "more"
    extra = {"train": [*TINY, "trainer.max_steps=1"], "eval": ["model=tiny", f"checkpoint={run}"],
             "sample": ["model=tiny", f"checkpoint={run}"],
             "export": [f"checkpoint={run}", f"output={tmp_path / 'out'}"]}[command]
    line = one_line_error(run_cli([command, *extra, f"hydra.run.dir={inside}"]))
    assert f"inside the run folder {run}" in line and "hydra.run.dir=" in line
    assert digests(run) == before and not (run / "checkpoints" / "more").exists()


@pytest.mark.parametrize("command", ["eval", "sample"])
def test_eval_and_sample_in_the_run_folder_itself_are_refused(trained_run, tmp_path, command):
    run = copy_run(trained_run, tmp_path / "run")
    before = digests(run)
    line = one_line_error(run_cli([command, "model=tiny", f"checkpoint={run}", f"hydra.run.dir={run}"]))
    assert f"is the run folder {run}" in line
    assert digests(run) == before  # .hydra/ included: Hydra never ran


def test_a_fresh_run_in_a_run_folder_leaves_its_hydra_records(trained_run, tmp_path):
    run = copy_run(trained_run, tmp_path / "run")
    before = digests(run)
    line = one_line_error(run_cli(["train", *TINY, "trainer.max_steps=1", f"hydra.run.dir={run}"]))
    assert "already holds a run" in line
    assert digests(run) == before


def test_train_in_process_refuses_a_folder_inside_a_run(trained_run, tmp_path):
    run = copy_run(trained_run, tmp_path / "run")
    before = digests(run)
    with pytest.raises(ConfigError, match="is inside the run folder"):
        train.run(tiny_cfg("trainer.max_steps=1"), run / "checkpoints" / "step_000002")
    assert digests(run) == before
