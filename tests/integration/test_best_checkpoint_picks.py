"""Which checkpoint each command takes from a run that recorded a best (RUN/best.json, written here with
checkpoint.record_best as grpo train's evals write it): export and sample take the best for checkpoint=RUN and say so,
RUN/best and RUN/last pick explicitly, eval ranks every checkpoint and marks the best, and a resume goes on from the
newest, never the best."""

from __future__ import annotations

import json

import pytest

from grpo_cli import checkpoint
from grpo_cli.commands import evaluate, export, sample, train
from grpo_cli.config import compose
from grpo_cli.errors import ConfigError
from tests.helpers.cli import one_line_error, run_cli
from tests.helpers.runs import EVAL_TINY, copy_run, metrics, tiny_cfg

BEST_LINE = "(the best by eval/accuracy 0.655; RUN/last takes the newest)"


@pytest.fixture()
def run(eval_run, tmp_path):
    """`eval_run` (checkpoints at steps 1 and 2) whose evals found step 1 the best."""
    folder = copy_run(eval_run, tmp_path / "run")
    checkpoint.record_best(folder, 1, "eval/accuracy", 0.655)
    return folder


def test_export_of_a_run_takes_its_best_and_says_so_and_run_last_takes_the_newest(trained_run_copy, tmp_path):
    run = trained_run_copy
    checkpoint.record_best(run, 1, "eval/accuracy", 0.655)
    out = run_cli(["export", f"checkpoint={run}", f"output={tmp_path / 'out'}", f"hydra.run.dir={tmp_path / 'h'}"])
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"checkpoint: {run}/checkpoints/step_000001 {BEST_LINE}" in out.stderr.splitlines()
    assert json.loads((tmp_path / "out" / "export.json").read_text())["step"] == 1
    # RUN/last and RUN/best are checked before any model loads
    for name, step in (("last", 2), ("best", 1)):
        cfg = compose("export", [f"checkpoint={run}/{name}", f"output={tmp_path / name}"])
        assert export.check(cfg)[0] == checkpoint.checkpoint_dir(run, step)


@pytest.mark.parametrize("name, step", [("best", 1), ("last", 2)])
def test_sample_takes_run_best_and_run_last(run, name, step, monkeypatch, capsys):
    loaded = []
    monkeypatch.setattr(checkpoint, "load_weights", lambda policy, ckpt: loaded.append(ckpt))
    sample.run(compose("sample", [*EVAL_TINY, f"checkpoint={run}/{name}", "sample.n=1", "sample.num_prompts=1"]))
    assert loaded == [checkpoint.checkpoint_dir(run, step)]
    assert f"checkpoint: {checkpoint.checkpoint_dir(run, step)} (" in capsys.readouterr().err


def test_run_best_of_a_run_without_evals_is_one_line_naming_run_last(eval_run, tmp_path, no_model):
    for command in ("sample", "rm"):
        out = run_cli([command, f"checkpoint={eval_run}/best", f"hydra.run.dir={tmp_path / command}"])
        line = one_line_error(out)
        assert f"{eval_run}/best: the run has no evals" in line and f"pass {eval_run}/last or {eval_run} " in line


def test_eval_of_a_run_ranks_every_checkpoint_and_marks_the_recorded_best(run, tmp_path, capsys):
    report = evaluate.run(compose("eval", [*EVAL_TINY, f"checkpoint={run}", "eval.limit=2"]), tmp_path / "eval")
    # every checkpoint, as before; step 1 is the one best.json names
    assert [(r["step"], r["best"]) for r in report["results"]] == [(1, True), (2, False)]
    err = capsys.readouterr().err
    assert "run/step_000001 (best)" in err and "(best): the run's best checkpoint" in err
    # RUN/best and RUN/last are one checkpoint each
    assert evaluate.expand_checkpoints(f"{run}/best") == [checkpoint.checkpoint_dir(run, 1)]
    assert evaluate.expand_checkpoints(f"{run}/last") == [checkpoint.checkpoint_dir(run, 2)]


def test_a_resume_goes_on_from_the_newest_checkpoint_not_the_best(four_step_run, tmp_path):
    run = copy_run(four_step_run, tmp_path / "run")
    checkpoint.record_best(run, 2, "eval/accuracy", 0.655)
    # max_steps=5: one step after the newest (4); from the best (2) it would set 3 and 4 aside and redo them
    last = train.run(tiny_cfg("trainer.max_steps=5", "trainer.save_every=1", "trainer.keep_last=null",
                              f"resume={run}"), run)
    assert last == checkpoint.checkpoint_dir(run, 5)
    assert [checkpoint.step_of(p) for p in checkpoint.list_checkpoints(run)] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4, 5]
    assert not list((run / "checkpoints").glob("abandoned-*"))


def test_a_bad_best_json_is_one_warning_and_a_run_takes_its_newest(run, tmp_path, capsys):
    (run / "best.json").write_text('{"step": 1, "checkpoint": "../../x", "metric": "eval/accuracy", "score": 1}')
    cfg = compose("export", [f"checkpoint={run}", f"output={tmp_path / 'out'}"])
    assert export.check(cfg)[0] == checkpoint.checkpoint_dir(run, 2)
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "best.json" in err and "the newest; the run has no best.json it can use" \
        in err
    with pytest.raises(ConfigError, match=r"best.json names \"checkpoint\" '../../x'"):
        export.check(compose("export", [f"checkpoint={run}/best", f"output={tmp_path / 'out'}"]))
