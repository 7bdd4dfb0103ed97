"""scripts/paired.py's train_or_resume: which `grpo train` it runs for a run folder in each state (the subprocess is
recorded, not run)."""

from __future__ import annotations

from tests.helpers.scripts import load_script

paired = load_script("paired")


def recorded(monkeypatch) -> list[list[str]]:
    calls = []
    monkeypatch.setattr(paired.subprocess, "call", lambda argv, **kw: calls.append(argv) or 0)
    return calls


def test_a_folder_cut_short_before_its_first_checkpoint_starts_again_from_step_0(tmp_path, monkeypatch):
    # killed during its first steps: metrics.jsonl and a log, no checkpoint; grpo train would refuse the folder
    run = tmp_path / "runs" / "arm_seed2"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    calls = recorded(monkeypatch)
    paired.train_or_resume(run, ["trainer.seed=2"])
    assert not run.exists()
    assert calls[0][-2:] == ["trainer.seed=2", f"hydra.run.dir={run}"]


def test_a_folder_with_a_checkpoint_is_resumed_in_place(tmp_path, monkeypatch):
    run = tmp_path / "runs" / "arm_seed2"
    (run / "checkpoints" / "step_000010").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 10}\n')
    calls = recorded(monkeypatch)
    paired.train_or_resume(run, ["trainer.seed=2"], trust=True)
    assert (run / "metrics.jsonl").exists()
    assert calls[0][-2:] == [f"resume={run}", "trust_run_config=true"]


def test_a_new_run_starts_in_its_folder(tmp_path, monkeypatch):
    run = tmp_path / "runs" / "arm_seed2"
    calls = recorded(monkeypatch)
    paired.train_or_resume(run, ["trainer.seed=2"])
    assert calls[0][-1] == f"hydra.run.dir={run}"
