"""Issue #23, "nothing lost, nothing silent", round 2: each fault the red team found is survived or
refused with one `error:` line (exit 2 for a setting or input, 1 when the run cannot go on), before
the model loads wherever the config alone decides it, and no file of an earlier run changes.

Item numbers are the issue's.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from test_runs import copy_run, grpo, one_line_error
from test_train import TINY, tiny_cfg

from grpo_cli.commands import train
from grpo_cli.errors import ConfigError


def digests(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder`, to prove a refusal changed nothing (.lock holds the last pid)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lock"}


@pytest.fixture(scope="module")
def run2(tmp_path_factory) -> Path:
    """A 2-step tiny run with a checkpoint at each step."""
    path = tmp_path_factory.mktemp("run2")
    train.run(tiny_cfg("trainer.max_steps=2", "trainer.save_every=1", "trainer.keep_last=null"), path)
    return path


# ---- 1. no run folder inside another run ----------------------------------------------------

@pytest.mark.parametrize("command", ["train", "eval", "sample", "export"])
def test_a_folder_inside_a_run_is_refused_before_hydra_writes(run2, tmp_path, command):
    run = copy_run(run2, tmp_path / "run")
    before = digests(run)
    inside = run / "checkpoints" / "step_000002" if command == "train" else run / "checkpoints" / "more"
    extra = {"train": [*TINY, "trainer.max_steps=1"], "eval": ["model=tiny", f"checkpoint={run}"],
             "sample": ["model=tiny", f"checkpoint={run}"],
             "export": [f"checkpoint={run}", f"output={tmp_path / 'out'}"]}[command]
    line = one_line_error(grpo(command, *extra, f"hydra.run.dir={inside}"))
    assert f"inside the run folder {run}" in line and "hydra.run.dir=" in line
    assert digests(run) == before and not (run / "checkpoints" / "more").exists()


@pytest.mark.parametrize("command", ["eval", "sample"])
def test_eval_and_sample_in_the_run_folder_itself_are_refused(run2, tmp_path, command):
    run = copy_run(run2, tmp_path / "run")
    before = digests(run)
    line = one_line_error(grpo(command, "model=tiny", f"checkpoint={run}", f"hydra.run.dir={run}"))
    assert f"is the run folder {run}" in line
    assert digests(run) == before  # .hydra/ included: Hydra never ran


def test_a_fresh_run_in_a_run_folder_leaves_its_hydra_records(run2, tmp_path):
    run = copy_run(run2, tmp_path / "run")
    before = digests(run)
    line = one_line_error(grpo("train", *TINY, "trainer.max_steps=1", f"hydra.run.dir={run}"))
    assert "already holds a run" in line
    assert digests(run) == before


def test_train_in_process_refuses_a_folder_inside_a_run(run2, tmp_path):
    run = copy_run(run2, tmp_path / "run")
    before = digests(run)
    with pytest.raises(ConfigError, match="is inside the run folder"):
        train.run(tiny_cfg("trainer.max_steps=1"), run / "checkpoints" / "step_000002")
    assert digests(run) == before
