"""`grpo eval` and `grpo sample` over damaged or mismatched runs: an adapter of another base model is refused in
one line, a corrupt checkpoint is skipped with one warning and the rest evaluated, only corrupt ones is an error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from grpo_cli.commands import evaluate, sample
from grpo_cli.config import compose
from tests.helpers.cli import run_cli, stopped
from tests.helpers.runs import EVAL_TINY, eval_cfg, snapshot


@pytest.mark.parametrize("override, setting", [
    ("model.loader.hidden_size=64", "model.loader.hidden_size=32, not 64"),
    ("model.loader.seed=1", "model.loader.seed=0, not 1"),  # same shapes: it would load and be silently wrong
    ("model.lora.r=8", "model.lora.r=4, not 8"),
])
def test_eval_refuses_a_base_model_override(eval_run, override, setting, no_model, tmp_path):
    # model=tiny: without it the composed model is eval.yaml's default, whose loader has no hidden_size
    code, err = stopped(run_cli(["eval", f"checkpoint={eval_run}", "model=tiny", override,
                                 f"hydra.run.dir={tmp_path}"]))
    assert code == 2 and err.splitlines() == [
        f"error: {eval_run}/checkpoints/step_000001 was trained with {setting}: its adapter fits only that base "
        f"model; drop the model override, or evaluate checkpoints of different base models apart"]


def test_eval_refuses_runs_of_two_base_models(eval_run, wide_eval_run, no_model, tmp_path):
    code, err = stopped(run_cli(["eval", f"checkpoint=[{eval_run},{wide_eval_run}]", f"hydra.run.dir={tmp_path}"]))
    assert code == 2 and err.splitlines() == [
        f"error: {wide_eval_run}/checkpoints/step_000001 was trained with model.loader.hidden_size=64, not 32: its "
        f"adapter fits only that base model; drop the model override, or evaluate checkpoints of different base "
        f"models apart"]
    code, err = stopped(run_cli(["sample", f"checkpoint={wide_eval_run}", "model=tiny", f"hydra.run.dir={tmp_path}"]))
    assert code == 2 and "step_000002 was trained with model.loader.hidden_size=64, not 32" in err


def test_an_adapter_that_does_not_fit_is_one_line(eval_run, wide_eval_run, tmp_path):
    """A checkpoint whose config.yaml claims the base it was not trained on: the shapes disagree at load."""
    ckpt = tmp_path / "liar" / "checkpoints" / "step_000001"
    shutil.copytree(wide_eval_run / "checkpoints" / "step_000001", ckpt)
    shutil.copy(eval_run / "checkpoints" / "step_000001" / "config.yaml", ckpt / "config.yaml")
    code, err = stopped(run_cli(["eval", f"checkpoint={ckpt}", "eval.limit=2", f"hydra.run.dir={tmp_path / 'out'}"]))
    # the engine's line ("sampler: ...") comes first: eval starts it before loading the checkpoints' adapters
    lines = [line for line in err.splitlines() if not line.startswith("sampler: ")]
    assert code == 2 and len(lines) == 1 and "adapter weights do not fit this model" in lines[0]
    assert str(ckpt / "adapter_model.safetensors") in err


def truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def nan_weights(file: Path) -> None:
    save_file({k: torch.full_like(v, float("nan")) for k, v in load_file(file).items()}, file)


@pytest.mark.parametrize("name, damage", [
    ("adapter_model.safetensors", truncate),
    ("adapter_model.safetensors", nan_weights),
    ("adapter_model.safetensors", Path.unlink),
    ("trainer_state.json", lambda f: f.write_text("{garbage")),
    ("trainer_state.json", Path.unlink),
    ("config.yaml", lambda f: f.write_text("model: [unclosed")),
], ids=["truncated", "nan", "adapter-missing", "state-garbage", "state-missing", "config-garbage"])
def test_eval_skips_a_corrupt_checkpoint(eval_run, name, damage, capfd, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(eval_run, run)
    damage(run / "checkpoints" / "step_000002" / name)
    before = snapshot(run)
    capfd.readouterr()
    report = evaluate.run(eval_cfg(f"checkpoint={run}", "eval.limit=2"), tmp_path / "out", [f"checkpoint={run}"])
    warnings = [line for line in capfd.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and f"{run}/checkpoints/step_000002/{name}" in warnings[0], warnings
    assert [r["step"] for r in report["results"]] == [1]
    assert [r["step"] for r in json.loads((tmp_path / "out" / "eval.json").read_text())["results"]] == [1]
    assert snapshot(run) == before  # the run folder is only read


def test_eval_of_only_corrupt_checkpoints_is_an_error(eval_run, no_model, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(eval_run, run)
    for step in (1, 2):
        truncate(run / "checkpoints" / f"step_00000{step}" / "adapter_model.safetensors")
    code, err = stopped(run_cli(["eval", f"checkpoint={run}", f"hydra.run.dir={tmp_path / 'out'}"]))
    lines = err.splitlines()
    assert code == 2 and len(lines) == 2  # one line per checkpoint, each naming its file
    for step, line in zip((1, 2), lines):
        assert line.startswith(f"error: {run}/checkpoints/step_00000{step}: ")
        assert f"step_00000{step}/adapter_model.safetensors cannot be read" in line


def test_sample_of_a_run_skips_its_corrupt_latest_checkpoint(eval_run, capfd, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(eval_run, run)
    truncate(run / "checkpoints" / "step_000002" / "adapter_model.safetensors")
    capfd.readouterr()
    records = sample.run(compose("sample", [*EVAL_TINY, f"checkpoint={run}", "sample.n=1", "sample.num_prompts=1"]))
    warnings = [line for line in capfd.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(records) == 1 and len(warnings) == 1 and "step_000002/adapter_model.safetensors" in warnings[0]
