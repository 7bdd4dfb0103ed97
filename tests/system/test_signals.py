"""Signals a user sends a running `grpo train`: Ctrl-C during the model load, a second SIGTERM while a reward
hangs, and kill -9 at random moments (the resumed run ends with the weights of one never killed)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from grpo_cli import checkpoint
from tests.helpers import REPO
from tests.helpers.cli import run_cli
from tests.helpers.runs import TINY, metrics


@pytest.mark.slow  # SIGINT to a grpo process (~11 s): make test-ci
@pytest.mark.ci
def test_ctrl_c_during_the_model_load_is_one_line(tmp_path):
    # a loader that signals when it starts, then takes its time: Ctrl-C lands inside the model load
    (tmp_path / "slowload.py").write_text(
        "import pathlib, time\n"
        "from grpo_cli.policy import load_tiny_random\n"
        "def load(marker, **kw):\n"
        "    pathlib.Path(marker).write_text('loading')\n"
        "    time.sleep(60)\n"
        "    return load_tiny_random(**kw)\n")
    marker = tmp_path / "loading"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    env.pop("HYDRA_FULL_ERROR", None)
    # a shell's background job inherits SIGINT ignored; give the child the default a terminal would
    proc = subprocess.Popen([sys.executable, "-m", "grpo_cli", "train", *TINY, "model.loader._target_=slowload.load",
                             "~model.loader.hidden_size", "~model.loader.num_layers", "~model.loader.num_heads",
                             "~model.loader.seed", f"+model.loader.marker={marker}", f"hydra.run.dir={tmp_path}/run"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while not marker.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "interrupted"


@pytest.mark.slow  # two SIGTERMs to a grpo process (~13 s): make test-ci
@pytest.mark.ci
def test_a_second_sigterm_stops_a_step_stuck_in_a_reward_without_timeout(tmp_path):
    (tmp_path / "hang.py").write_text(
        "import pathlib, time\n"
        "def reward(prompts, completions, marker, **_):\n"
        "    pathlib.Path(marker).write_text('in reward')\n"
        "    time.sleep(600)\n"
        "    return [0.0] * len(completions)\n")
    marker = tmp_path / "in_reward"
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["PYTHONPATH"] = str(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "grpo_cli", "train", *TINY, "reward.timeout_s=null",
                             f"+reward.functions.hang={{_target_:hang.reward,_partial_:true,marker:'{marker}'}}",
                             "+reward.weights.hang=1.0", f"hydra.run.dir={tmp_path}/run"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not marker.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)  # the first asks for a checkpoint after the step, which never ends
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)  # the second aborts
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "interrupted"


@pytest.mark.slow
def test_kill_9_at_random_moments_then_resume_gives_the_uninterrupted_weights(tmp_path):
    """At least 20 kill -9 at random moments (start-up, sampling, update, checkpoint writing), each
    followed by a resume; the final adapter equals an uninterrupted run's, bit for bit."""
    import shutil

    steps = 60
    common = [*TINY, f"trainer.max_steps={steps}", "trainer.save_every=1", "trainer.keep_last=2"]
    straight = tmp_path / "straight"
    assert run_cli(["train", *common, f"hydra.run.dir={straight}"]).returncode == 0
    run, kills, rng = tmp_path / "killed", 0, random.Random(0)
    while True:
        if checkpoint.list_checkpoints(run):
            args = [f"resume={run}", f"hydra.run.dir={tmp_path}/hydra{kills}"]
        else:  # killed before the first checkpoint: nothing to resume, start again
            shutil.rmtree(run, ignore_errors=True)
            args = [*common, f"hydra.run.dir={run}"]
        proc = subprocess.Popen([sys.executable, "-m", "grpo_cli", "train", *args], cwd=REPO,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if kills < 20:
            time.sleep(rng.uniform(1.0, 6.0))
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                kills += 1
                continue
        out = proc.communicate(timeout=900)[1]
        assert proc.returncode == 0, out[-2000:]
        if checkpoint.resolve(run).name == f"step_{steps:06d}":
            break
    assert kills >= 20
    assert [r["step"] for r in metrics(run)] == list(range(1, steps + 1))
    a = load_file(straight / "checkpoints" / f"step_{steps:06d}" / "adapter_model.safetensors")
    b = load_file(run / "checkpoints" / f"step_{steps:06d}" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
