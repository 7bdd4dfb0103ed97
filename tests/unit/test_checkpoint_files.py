"""A checkpoint's JSON files are checked by shape (types and keys) when read, not only parsed: a file that parses but
is not what grpo train writes is one CheckpointError line naming the file and the key, before any model loads."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from grpo_cli import checkpoint
from grpo_cli.errors import CheckpointError


def _edit(ckpt: Path, name: str, change) -> None:
    file = ckpt / name
    file.write_text(json.dumps(change(json.loads(file.read_text()))))


def _without(key: str):
    return lambda d: {k: v for k, v in d.items() if k != key}


def _group(key: str, value):
    return lambda d: {**d, "param_groups": [{**d["param_groups"][0], key: value}]}


# (file, change, what the error line says): each one parses as JSON and would fail on resume or after the model loads
CASES = {
    "state is a list": ("trainer_state.json", lambda d: [], r"trainer_state.json .*must be an object.*got list"),
    "step is text": ("trainer_state.json", lambda d: {**d, "step": "two"}, r"\"step\" must be an integer >= 0.*'two'"),
    "step is missing": ("trainer_state.json", _without("step"), r"has no \"step\""),
    "data is missing": ("trainer_state.json", _without("data"), r"has no \"data\""),
    "data position is text": ("trainer_state.json", lambda d: {**d, "data": {**d["data"], "position": "x"}},
                              r"\"data.position\" must be an integer >= 0"),
    "history is not a list": ("trainer_state.json", lambda d: {**d, "history": {}}, r"\"history\" must be a list"),
    "rng is not numbers": ("trainer_state.json", lambda d: {**d, "rng": {"torch": "x"}},
                           r"\"rng.torch\" must be a list of integers"),
    "lr is text": ("optimizer.json", _group("lr", "x"), r"\"param_groups.0.lr\" must be a number.*'x'"),
    "betas are one number": ("optimizer.json", _group("betas", 0.9), r"\"param_groups.0.betas\" must be a list of 2"),
    "no param_groups": ("optimizer.json", _without("param_groups"), r"has no \"param_groups\""),
    "a tensor it does not hold": ("optimizer.json",
                                  lambda d: {**d, "state": {**d["state"], "0": {"exp_avg": {"tensor": "nowhere"}}}},
                                  r"names tensor 'nowhere', which optimizer.safetensors does not hold"),
    "scheduler is a list": ("scheduler.json", lambda d: [1], r"scheduler.json .*must be an object"),
    "last_epoch is text": ("scheduler.json", lambda d: {**d, "last_epoch": "x"}, r"\"last_epoch\" must be an integer"),
    "base_lrs are text": ("scheduler.json", lambda d: {**d, "base_lrs": ["x"]},
                          r"\"base_lrs\" must be a list of numbers"),
}


@pytest.fixture()
def ckpt(trained_run, tmp_path) -> Path:
    return Path(shutil.copytree(checkpoint.list_checkpoints(trained_run)[-1], tmp_path / "step_000002"))


def test_a_checkpoint_as_written_verifies(ckpt):
    checkpoint.verify(ckpt)


@pytest.mark.parametrize("case", list(CASES))
def test_a_file_of_the_wrong_shape_is_named(ckpt, case):
    name, change, expected = CASES[case]
    _edit(ckpt, name, change)
    with pytest.raises(CheckpointError) as err:
        checkpoint.verify(ckpt)
    line = str(err.value)
    assert "\n" not in line and str(ckpt / name) in line and re.search(expected, line), line


def test_a_config_read_again_is_the_callers_own_and_an_edited_one_is_read_anew(ckpt):
    checkpoint.verify(ckpt)  # reads config.yaml, as eval and sample do before they read it again
    first = checkpoint.load_config(ckpt)
    first.trainer.max_steps = 99  # a caller changes its copy (read_saved anchors paths, upgrade fills keys)
    assert checkpoint.load_config(ckpt).trainer.max_steps == 2
    file = ckpt / "config.yaml"
    file.write_text(file.read_text() + "a: &x [1]\nb: *x\n")  # an alias now: refused, not the config kept before
    for read in (checkpoint.load_config, checkpoint.verify):
        with pytest.raises(CheckpointError, match=r"config.yaml cannot be read \(it holds a YAML alias"):
            read(ckpt)
