"""Someone else's run folder is data: reading it back (eval, sample, resume, export) runs no code it names unless the
user trusts it, and a run started in one folder is resumed and evaluated from another."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from tests.helpers.cli import one_line_error, run_cli
from tests.helpers.runs import TINY, metrics, write_jsonl


def _write(file: Path, text: str) -> dict:
    """A node that writes `text` to `file` when built (`Path.write_text`, which returns len(text))."""
    return {"_target_": "pathlib.Path.write_text", "self": {"_target_": "pathlib.Path", "_args_": [str(file)]},
            "data": text}


def plant(run: Path, where: Path, reward: bool = True) -> tuple[Path, Path]:
    """Write the issue's chained payload into every config.yaml of `run`; (its side-effect files).

    model.loader.hidden_size: `Path.write_text` of a 32-character text returns 32, the tiny model's own width, so
    a run that trusts it still loads. reward.weights: `Path.write_text` writes a .py file that reward.funcs (a
    CustomReward) then imports; that file, run, writes `pwned`."""
    model_marker, reward_marker, payload = where / "model_marker", where / "pwned", where / "payload.py"
    source = (f"import pathlib\npathlib.Path({str(reward_marker)!r}).write_text('x')\n"
              f"def fn(prompts, completions, **kwargs):\n    return [0.0] * len(completions)\n")
    for config in run.glob("checkpoints/step_*/config.yaml"):
        cfg = OmegaConf.load(config)
        cfg.model.loader.hidden_size = _write(model_marker, "x" * 32)  # 32 characters -> 32
        if reward:
            cfg.reward = {"_target_": "grpo_cli.rewards.user.CustomReward", "funcs": [f"{payload}:fn"],
                          "weights": [_write(payload, source)], "timeout_s": 10}
        OmegaConf.save(cfg, config)
    return model_marker, reward_marker


def _argv(command: str, run: Path, out: Path) -> list[str]:
    return {"eval": ["eval", f"checkpoint={run}", "eval.limit=2", f"hydra.run.dir={out}"],
            "sample": ["sample", f"checkpoint={run}", "sample.num_prompts=1", "sample.n=1", f"hydra.run.dir={out}"],
            "resume": ["train", f"resume={run}", "trainer.max_steps=3"],
            "export": ["export", f"checkpoint={run}", f"output={out / 'model'}", f"hydra.run.dir={out}"]}[command]


@pytest.mark.parametrize("command", ["eval", "sample", "resume", "export"])
def test_a_planted_config_runs_no_code(trained_run_copy, tmp_path, command):
    markers = plant(trained_run_copy, tmp_path)
    line = one_line_error(run_cli(_argv(command, trained_run_copy, tmp_path / "out")))
    assert "model.loader.hidden_size._target_ (pathlib.Path.write_text)" in line, line
    assert "trust_run_config=true" in line, line
    assert not any(m.exists() for m in markers) and not (tmp_path / "payload.py").exists()


def test_a_trusted_run_config_runs(trained_run_copy, tmp_path):
    """Trusted, both planted pieces run: the model node's write, and the reward file (written here beforehand:
    reward.weights must be numbers, so the chain through it is a config error even in a trusted run)."""
    markers = plant(trained_run_copy, tmp_path)
    for config in trained_run_copy.glob("checkpoints/step_*/config.yaml"):
        cfg = OmegaConf.load(config)
        instantiate(cfg.reward.weights[0])  # the planted write_text node, run by the test: payload.py
        cfg.reward.weights = None
        OmegaConf.save(cfg, config)
    code, _, err = run_cli([*_argv("eval", trained_run_copy, tmp_path / "out"), "trust_run_config=true"])
    assert code == 0, err[-2000:]
    assert all(m.exists() for m in markers)
    assert f"reward functions from {tmp_path / 'payload.py'} (saved with the run)" in err


def test_a_node_given_on_the_command_line_is_trusted(trained_run_copy, tmp_path):
    """The command line replaces the planted model node (the reward is the run's own again): nothing planted runs."""
    model_marker, _ = plant(trained_run_copy, tmp_path, reward=False)
    code, _, err = run_cli([*_argv("export", trained_run_copy, tmp_path / "out"), "model=tiny",
                            "model.loader.hidden_size=32"])
    assert code == 0, err[-2000:]
    assert not model_marker.exists()


def test_a_reward_file_shipped_inside_the_run_folder_does_not_run(trained_run_copy, tmp_path):
    """grpo train never writes code into a run folder: a reward file there came with the run, not from the user."""
    marker, payload = tmp_path / "pwned", trained_run_copy / "rewards.py"
    payload.write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('x')\n"
                       f"def fn(prompts, completions, **kwargs):\n    return [0.0] * len(completions)\n")
    for config in trained_run_copy.glob("checkpoints/step_*/config.yaml"):
        cfg = OmegaConf.load(config)
        cfg.reward = {"_target_": "grpo_cli.rewards.user.CustomReward", "funcs": [f"{payload}:fn"], "weights": None,
                      "timeout_s": 10}
        OmegaConf.save(cfg, config)
    line = one_line_error(run_cli(_argv("sample", trained_run_copy, tmp_path / "out")))
    assert f"reward.funcs ({payload}) lies inside the run folder" in line and "trust_run_config=true" in line, line
    assert not marker.exists()


# ---- from any folder ----------------------------------------------------------------------------------------------

def test_a_run_with_relative_paths_resumes_and_evaluates_from_another_folder(tmp_path):
    start, elsewhere, run = tmp_path / "start", tmp_path / "elsewhere", tmp_path / "run"
    elsewhere.mkdir()
    (start / "data").mkdir(parents=True)
    write_jsonl(start / "data" / "problems.jsonl", [{"question": f"{i} + 1?", "answer": i + 1} for i in range(8)])
    data = ["data=jsonl", "data.path=data/problems.jsonl", "data.heldout_size=2"]
    code, _, err = run_cli(["train", *TINY, *data, "trainer.max_steps=1", f"hydra.run.dir={run}"], cwd=start)
    assert code == 0, err[-2000:]
    code, _, err = run_cli(["train", f"resume={run}", "trainer.max_steps=2"], cwd=elsewhere)
    assert code == 0, err[-2000:]
    assert [m["step"] for m in metrics(run)] == [1, 2]
    code, _, err = run_cli(["eval", f"checkpoint={run}", "eval.limit=2", f"hydra.run.dir={tmp_path / 'eval'}"],
                           cwd=elsewhere)
    assert code == 0, err[-2000:]
    assert [r["num_problems"] for r in json.loads((tmp_path / "eval" / "eval.json").read_text())["results"]] == [2, 2]
