"""The trainer's state as one typed record (grpo_cli.trainer_state.TrainerState): trainer_state.json read and written
back key for key, from today's grpo train and from checkpoints older than some of its keys."""

from __future__ import annotations

import dataclasses
import json

from grpo_cli.json_shapes import SHAPES
from grpo_cli.trainer_state import TrainerState
from tests.helpers import REPO

SAVED = REPO / "tests" / "data" / "old_runs" / "2026-12-06" / "checkpoints" / "step_000001" / "trainer_state.json"


def test_the_2026_12_06_file_reads_and_writes_back_byte_for_byte():
    text = SAVED.read_text()
    state = TrainerState.from_json(json.loads(text))
    assert state.step == 1 and state.world_size == 1 and state.data == {"position": 2, "seed": 0, "size": 100000}
    assert state.iterative is None and state.ahead is None and state.guard is None  # none of them in this run
    assert json.dumps(state.to_json(), indent=1) == text  # as checkpoint.save writes it


def test_an_older_file_without_the_later_keys_loads_and_leaves_them_out():
    # a checkpoint saved before world_size, dtype, started_in and rng were kept: what json_shapes requires alone
    older = {"step": 3, "history": [{"step": 1}], "data": {"position": 6}}
    state = TrainerState.from_json(older)
    assert (state.world_size, state.dtype, state.started_in, state.rng) == (None, None, None, None)
    assert state.to_json() == older


def test_every_key_keeps_its_place():
    # an iterative run with rollouts in flight and a guard decision: the order grpo train writes them in
    full = {"step": 2, "history": [], "dtype": "float32", "started_in": "/x", "iterative": {"done": 1},
            "world_size": 2, "data": {"position": 4}, "rng": {"torch": [0]}, "ahead": {"3": {}},
            "guard": {"decisions": 1, "rewinds": 1, "lr_scale": 0.5, "is_correction": None, "is_correction_cap": None}}
    assert list(TrainerState.from_json(full).to_json().items()) == list(full.items())


def test_its_fields_are_the_keys_json_shapes_checks():
    top = [key for key, *_ in SHAPES["trainer_state.json"] if "." not in key]
    assert sorted(f.name for f in dataclasses.fields(TrainerState)) == sorted(top)
