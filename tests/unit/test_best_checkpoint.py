"""The best checkpoint of a run: `record_best` keeps RUN/best.json (the step whose held-out eval scored highest), and
`best_checkpoint` reads it back as data from anyone: a file that is not what grpo train writes names no checkpoint."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from grpo_cli import checkpoint, inference
from grpo_cli.errors import CheckpointError


def _best(run: Path) -> dict:
    return json.loads((run / "best.json").read_text())


def test_a_higher_score_replaces_the_record_and_an_equal_one_does_not(tmp_path):
    # no record yet: the first eval is the best so far
    assert checkpoint.record_best(tmp_path, 10, "eval/accuracy", 0.48) is True
    # 0.655 > 0.48: step 20 is the best
    assert checkpoint.record_best(tmp_path, 20, "eval/accuracy", 0.655) is True
    # 0.59 < 0.655: kept
    assert checkpoint.record_best(tmp_path, 30, "eval/accuracy", 0.59) is False
    # 0.655 == 0.655: kept too. A tie is no evidence that the later checkpoint is better, and the earlier one has
    # drifted less from where RL started; the record would otherwise move on every tie.
    assert checkpoint.record_best(tmp_path, 40, "eval/accuracy", 0.655) is False
    assert _best(tmp_path) == {"step": 20, "checkpoint": "checkpoints/step_000020", "metric": "eval/accuracy",
                               "score": 0.655}


def test_a_score_that_is_not_finite_is_never_the_best(tmp_path):
    checkpoint.record_best(tmp_path, 10, "eval/accuracy", 0.48)
    # NaN > 0.48 is False, but a NaN record would lose to nothing after it: refused outright
    assert checkpoint.record_best(tmp_path, 20, "eval/accuracy", float("nan")) is False
    assert _best(tmp_path)["step"] == 10


@pytest.fixture()
def run(trained_run, tmp_path) -> Path:
    """A run folder with the tiny run's checkpoint at step 2 (and no best.json)."""
    folder = tmp_path / "run"
    shutil.copytree(checkpoint.checkpoint_dir(trained_run, 2), checkpoint.checkpoint_dir(folder, 2))
    return folder


def test_the_recorded_checkpoint_is_read_back(run):
    assert checkpoint.best_checkpoint(run) is None  # no evals: no best
    checkpoint.record_best(run, 2, "eval/accuracy", 0.5)
    assert checkpoint.best_checkpoint(run) == checkpoint.checkpoint_dir(run, 2)


def test_a_recorded_checkpoint_that_is_gone_or_damaged_is_none(run):
    checkpoint.record_best(run, 2, "eval/accuracy", 0.5)
    (checkpoint.checkpoint_dir(run, 2) / "scheduler.json").write_text("{")
    lines = []
    assert checkpoint.best_checkpoint(run, warn=lines.append) is None
    assert len(lines) == 1 and "scheduler.json" in lines[0]
    shutil.rmtree(checkpoint.checkpoint_dir(run, 2))
    lines.clear()
    assert checkpoint.best_checkpoint(run, warn=lines.append) is None
    assert len(lines) == 1 and "step_000002" in lines[0] and "gone" in lines[0]


# best.json as someone else may have written it: each is one CheckpointError line naming the file, never a path
# followed out of the run folder, a read that blocks or a traceback
BAD = {
    "a checkpoint out of the run": lambda f: f.write_text(json.dumps(
        {"step": 2, "checkpoint": "../../x", "metric": "eval/accuracy", "score": 1.0})),
    "a checkpoint of another step": lambda f: f.write_text(json.dumps(
        {"step": 2, "checkpoint": "checkpoints/step_000001", "metric": "eval/accuracy", "score": 1.0})),
    "garbage": lambda f: f.write_text("{not json"),
    "a list": lambda f: f.write_text("[]"),
    "a score that is text": lambda f: f.write_text(json.dumps(
        {"step": 2, "checkpoint": "checkpoints/step_000002", "metric": "eval/accuracy", "score": "high"})),
    "a FIFO": lambda f: os.mkfifo(f),  # an open() of it would wait for a writer forever
    "a link to another file": lambda f: f.symlink_to("/etc/hostname"),
    "too large": lambda f: f.write_text(" " * 100_000 + "{}"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_best_json_that_grpo_train_did_not_write_names_no_checkpoint(run, case):
    BAD[case](run / "best.json")
    with pytest.raises(CheckpointError) as err:
        checkpoint.read_best(run)
    assert "best.json" in str(err.value) and "\n" not in str(err.value)
    lines = []
    assert checkpoint.best_checkpoint(run, warn=lines.append) is None
    assert len(lines) == 1
    # the next eval replaces it as if none were recorded (with its one line): training goes on
    assert checkpoint.record_best(run, 2, "eval/accuracy", 0.25, warn=lines.append) is True
    assert len(lines) == 2 and checkpoint.best_checkpoint(run) == checkpoint.checkpoint_dir(run, 2)


def test_keep_last_never_deletes_the_best_checkpoint(tmp_path):
    from grpo_cli.config import compose
    from grpo_cli.policy import build_policy
    from tests.helpers.runs import TINY

    cfg = compose("train", TINY)
    policy, _, _ = build_policy(cfg.model)
    optimizer = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    for step in (1, 2, 3):
        state = {"step": step, "history": [], "data": {"position": 0}}  # what a trainer_state holds (its SHAPES)
        checkpoint.save(tmp_path, step, policy, optimizer, scheduler, state, cfg, keep_last=1)
        if step == 1:
            checkpoint.record_best(tmp_path, 1, "eval/accuracy", 0.655)
    # keep_last=1 keeps step 3, the newest, and step 1, the best; step 2 goes
    assert [checkpoint.step_of(p) for p in checkpoint.list_checkpoints(tmp_path)] == [1, 3]


def test_a_branch_that_sets_the_best_aside_takes_its_record_with_it(tmp_path):
    for step in (1, 2, 3):
        checkpoint.checkpoint_dir(tmp_path, step).mkdir(parents=True)
        (checkpoint.checkpoint_dir(tmp_path, step) / "trainer_state.json").write_text("{}")
    checkpoint.record_best(tmp_path, 2, "eval/accuracy", 0.655)
    # resume=RUN/checkpoints/step_000001: steps 2 and 3 are an abandoned branch, and so is their best
    aside = checkpoint.set_aside_after(tmp_path, 1)
    assert not (tmp_path / "best.json").exists() and _best(aside)["step"] == 2
    # the new branch's first eval is its best, however it compares with the abandoned one's 0.655
    assert checkpoint.record_best(tmp_path, 2, "eval/accuracy", 0.5) is True


def test_run_best_and_run_last_pick_and_a_run_folder_takes_the_best(trained_run_copy):
    run, step = trained_run_copy, lambda pair: checkpoint.step_of(pair[0])
    # no evals: a run folder takes its newest, and RUN/best is one line naming the other two
    assert step(inference.pick(run)) == 2 and "no evals" in inference.pick(run)[1]
    with pytest.raises(CheckpointError, match=rf"^{run}/best: the run has no evals .* pass {run}/last or {run} "):
        inference.pick(run / "best")
    checkpoint.record_best(run, 1, "eval/accuracy", 0.655)
    assert inference.pick(run) == (checkpoint.checkpoint_dir(run, 1),
                                    "the best by eval/accuracy 0.655; RUN/last takes the newest")
    assert step(inference.pick(run / "best")) == 1
    assert inference.pick(run / "last") == (checkpoint.checkpoint_dir(run, 2), "the newest, as RUN/last asks")
    # a checkpoint folder is taken as given, with nothing to say
    assert inference.pick(checkpoint.checkpoint_dir(run, 2)) == (checkpoint.checkpoint_dir(run, 2), None)
