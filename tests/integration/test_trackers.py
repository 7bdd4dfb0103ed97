"""Experiment trackers (`trainer.report_to`): each writes its local files in a 2-step tiny run, with
the config as hyper-parameters and the per-step metrics as scalars; a bad or missing tracker stops
the run with one line before the model loads. Each tracker's test is skipped, saying why, when its
package is absent (the CI install has trackio, from the `test` extra)."""

from __future__ import annotations

import importlib.util
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_cli import recipe
from grpo_cli.commands import train
from grpo_cli.config import compose
from grpo_cli.errors import ConfigError
from grpo_cli.metrics import trackers
from tests.helpers import REPO
from tests.helpers.cli import run_cli

# the digit reward gives the tiny model's random text rewards that differ from step to step
TINY = ["+reward.functions.digit={_target_:grpo_cli.rewards.outcome.format_reward,_partial_:true,pattern:'[0-9]'}",
        "+reward.weights.digit=1.0", "model=tiny", "sampler.max_new_tokens=8", "algo.group_size=4",
        "trainer.prompts_per_step=2", "trainer.micro_batch_size=4", "trainer.max_steps=2",
        "trainer.log_completions_every=null", "trainer.eval_every=null"]


def needs(*packages: str):
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    return pytest.mark.skipif(bool(missing), reason=f"{', '.join(missing)} not installed "
                                                    f"(pip install 'grpo-cli[trackers]')")


def two_steps(run_dir: Path, *overrides: str) -> list[dict]:
    """A 2-step tiny run into run_dir; returns its metrics.jsonl records."""
    train.run(compose("train", [*TINY, *overrides]), run_dir)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@needs("tensorboard")
def test_tensorboard_writes_scalars_and_hparams(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    records = two_steps(tmp_path, "trainer.report_to=[tensorboard]")
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    for key in ("reward", "completions/mean_length"):
        assert [e.step for e in events.Scalars(key)] == [1, 2]
        assert [e.value for e in events.Scalars(key)] == pytest.approx([r[key] for r in records])
    assert records[0]["reward"] != records[1]["reward"]  # the values are told apart, not just present
    start = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(start).session_start_info.hparams
    assert hparams["algo.group_size"].number_value == 4 and hparams["model.name"].string_value == "tiny-random-llama"


@needs("wandb")
def test_wandb_writes_an_offline_run_in_the_run_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    two_steps(tmp_path, "trainer.report_to=[wandb]")
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    # the .wandb file is W&B's protobuf record log: the metric names and config keys are in it as
    # strings (reading it back needs wandb's internal reader or a sync to a server)
    data = runs[0].read_bytes()
    for key in (b"rewards/digit/mean", b"completions/mean_length", b"group_size", b"tiny-random-llama"):
        assert key in data, key


@needs("mlflow", "sqlalchemy", "alembic")
def test_mlflow_writes_a_sqlite_store_in_the_run_folder(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    records = two_steps(tmp_path, "trainer.report_to=[mlflow]", "trainer.project=grpo-test")
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("grpo-test").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["algo.group_size"] == "4"
    history = client.get_metric_history(run.info.run_id, "reward")
    assert [m.step for m in history] == [1, 2]
    assert [m.value for m in history] == pytest.approx([r["reward"] for r in records])


@pytest.mark.slow  # a fresh process: trackio reads TRACKIO_DIR at import (~15 s): make test-ci
@pytest.mark.ci
@needs("trackio")
def test_trackio_writes_its_local_store(tmp_path):
    # trackio reads TRACKIO_DIR once, at import: a fresh process points it at tmp_path, through the CLI
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "store"), "OMP_NUM_THREADS": "1"}
    env.pop("TRACKIO_SPACE_ID", None)
    run_dir = tmp_path / "2026-01-01" / "10-00-00"
    out = subprocess.run([sys.executable, "-m", "grpo_cli", "train", *TINY, "trainer.report_to=[trackio]",
                          f"hydra.run.dir={run_dir}"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    db = sqlite3.connect(tmp_path / "store" / "grpo-cli.db")  # trackio's documented schema: one DB per project
    logged = db.execute("SELECT run_name, step, metrics FROM metrics ORDER BY step").fetchall()
    assert [(name, step) for name, step, _ in logged] == [("2026-01-01/10-00-00", 1), ("2026-01-01/10-00-00", 2)]
    for (_, _, values), record in zip(logged, records):
        assert json.loads(values)["reward"] == pytest.approx(record["reward"])
    [(config,)] = db.execute("SELECT config FROM configs").fetchall()
    assert json.loads(config)["algo"]["group_size"] == 4


def test_auto_is_tensorboard_when_installed_else_nothing(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert trackers.resolve_report_to("auto") == []
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    assert trackers.resolve_report_to("auto") == ["tensorboard"]
    assert trackers.resolve_report_to([]) == [] and trackers.resolve_report_to("wandb") == ["wandb"]


def test_a_missing_tracker_package_stops_before_the_model_loads(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    monkeypatch.setattr(recipe, "build_policy", lambda *_: pytest.fail("the model was loaded"))
    with pytest.raises(ConfigError, match=r"^trainer.report_to includes wandb but the wandb package is not installed: "
                                          r"pip install 'grpo-cli\[wandb\]'"):
        two_steps(tmp_path, "trainer.report_to=[wandb]")  # alone: tensorboard may be absent too (CI)
    with pytest.raises(ConfigError, match=r"'neptune' is not a tracker; use any of tensorboard, wandb, trackio"):
        two_steps(tmp_path, "trainer.report_to=[neptune]")


def test_cli_missing_tracker_is_one_line_exit_2(tmp_path):
    # a name that can never be installed: the unknown-tracker error, end to end through Hydra
    out = run_cli(["train", *TINY, "trainer.report_to=[tensorbord]", f"hydra.run.dir={tmp_path}"])
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "trainer.report_to: 'tensorbord' is not a tracker" in out.stderr
