"""The guard (trainer.guard) on the tiny model: a planted fault makes it rewind to the last checkpoint that passed,
apply its remedy, write guard.jsonl and print one line; a rewind restores the weights, optimizer and data position;
the rewinds are bounded; a run killed after a rewind, or between the set-aside and the decision's line, resumes to
the same decisions and the same final adapter; bad settings are refused before the model loads.

The planted fault is an injected eval metric (the held-out gate reads it as it reads a real one): 0.900 at step 2,
and at step 4 0.000 while the learning rate is the one configured (a rate too high, collapsing the policy) and
0.850 once a remedy has lowered it. The tiny random model's real accuracy is 0 at every step, which no gate can
tell from a drop."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from grpo_cli import guard, recipe
from grpo_cli.commands import train
from grpo_cli.config import compose
from grpo_cli.guard import GuardState
from grpo_cli.metrics.stats import wilson_interval
from tests.helpers.cli import one_line_error, run_cli
from tests.helpers.runs import TINY, deterministic, metrics

# TINY with the default guard on (its heuristic tripwires wait for 10 steps, longer than these runs; HF generate logs
# no sampler/logp_gap), 4 steps, an eval of 4 held-out problems and a checkpoint every 2
GUARDED = [o for o in TINY if o != "trainer.guard=null"] + [
    "trainer.max_steps=4", "trainer.eval_every=2", "trainer.eval_size=4", "trainer.save_every=2"]


def planted(lowered_cures: bool = True):
    """recipe.held_out with the fault planted in its numbers (the module's docstring)."""
    real = recipe.held_out

    def held_out(run, record):
        scores = real(run, record)
        lowered = GuardState.of(run.state.guard).lr_scale < 1
        accuracy = {2: 0.9, 4: 0.85 if lowered and lowered_cures else 0.0}.get(record.step, 0.85)
        low, high = wilson_interval(round(accuracy * 20), 20)  # as if of 20 problems: 0.9 is 0.70-0.97, 0 is 0-0.16
        fake = {"eval/accuracy": accuracy, "eval/accuracy_low": low, "eval/accuracy_high": high}
        for numbers in (scores, record.metrics, run.state.history[-1]):
            numbers.update(fake)
        return scores

    return held_out


def _adapter(run, step: int = 4) -> dict:
    return load_file(run / "checkpoints" / f"step_{step:06d}" / "adapter_model.safetensors")


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _decisions(run) -> list[dict]:
    return [json.loads(line) for line in (run / "guard.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """(run folder, console) of the guarded run with the planted fault, through the command."""
    folder = tmp_path_factory.mktemp("guarded") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train, "held_out", planted())
        out = run_cli(["train", *GUARDED, f"hydra.run.dir={folder}"])
    assert out.returncode == 0, out.stderr[-3000:]
    return folder, out.stdout + out.stderr


@pytest.fixture(scope="module")
def unguarded(tmp_path_factory):
    """The same run with the guard off: the fault stays."""
    folder = tmp_path_factory.mktemp("unguarded") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train, "held_out", planted())
        train.run(compose("train", [*GUARDED, "trainer.guard=null"]), folder)
    return folder


def test_a_planted_fault_rewinds_the_run_applies_the_remedy_and_writes_its_decision(guarded, unguarded):
    run, console = guarded
    (decision,) = _decisions(run)
    # the held-out gate at step 4: 0.000 (0.00-0.16) lies wholly below step 2's 0.900 (0.70-0.97); the newest
    # checkpoint that passed is step 2's (its eval); the remedy halves the learning rate
    assert {k: decision[k] for k in ("step", "tripwire", "rewound_to", "remedy", "rewind", "max_rewinds", "changes")} \
        == {"step": 4, "tripwire": "heldout_drop", "rewound_to": 2, "remedy": "lr", "rewind": 1, "max_rewinds": 2,
            "changes": {"lr_factor": 0.5}}
    assert decision["values"]["accuracy"] == 0.0 and decision["values"]["best_step"] == 2
    lines = [line for line in console.splitlines() if line.startswith("guard:")]
    assert lines == ["guard: step 4: held-out accuracy 0.000 (0.00-0.16) below the best, 0.900 at step 2 (0.70-0.97); "
                     "rewound to step 2, learning rate x0.5 (rewind 1 of 2)"]
    records = metrics(run)
    # the files read as one run: steps 3-4 of the abandoned pass are gone; 0.05 up to step 2, 0.025 from step 3
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["learning_rate"] for r in records] == [0.05, 0.05, 0.025, 0.025]
    assert [r["eval/accuracy"] for r in records if "eval/accuracy" in r] == [0.9, 0.85]
    state = json.loads((run / "checkpoints/step_000004/trainer_state.json").read_text())
    assert state["guard"] == {"decisions": 1, "rewinds": 1, "lr_scale": 0.5, "is_correction": None,
                              "is_correction_cap": None}
    # unguarded, the fault stays: step 4 scores 0.000 and nothing is written
    assert [r["eval/accuracy"] for r in metrics(unguarded) if "eval/accuracy" in r] == [0.9, 0.0]
    assert not (unguarded / "guard.jsonl").exists()


def test_the_rewind_restores_weights_optimizer_and_data_position(guarded, unguarded):
    run, _ = guarded
    # step 3 after the rewind samples, scores and computes its loss from step 2's weights, its optimizer state and
    # its place in the prompt stream: everything as in the unguarded run's step 3 but the rate its update takes
    ours, theirs = (deterministic(metrics(r)[2]) for r in (run, unguarded))
    assert ours.pop("learning_rate") == 0.025 and theirs.pop("learning_rate") == 0.05
    assert ours == theirs
    # and from there on the halved rate trains other weights
    assert not _same(_adapter(run), _adapter(unguarded))


def test_the_rewinds_are_bounded_and_then_the_run_stops_where_it_last_passed(tmp_path):
    # the fault stays whatever the rate: rewind 1 of 1 halves it, the next firing stops the run at step 2
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train, "held_out", planted(lowered_cures=False))
        out = run_cli(["train", *GUARDED, "trainer.guard.max_rewinds=1", f"hydra.run.dir={tmp_path}"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert [(d["remedy"], d["rewound_to"], d["rewind"]) for d in _decisions(tmp_path)] == [("lr", 2, 1),
                                                                                          ("stop", 2, 1)]
    lines = [line for line in out.stderr.splitlines() if line.startswith("guard:")]
    assert len(lines) == 2 and lines[1].endswith("rewound to step 2 and stopped (trainer.guard.max_rewinds=1 spent)")
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2]
    assert f"checkpoint: {tmp_path / 'checkpoints' / 'step_000002'}" in out.stderr


def test_a_stop_goes_to_the_best_checkpoint_that_passed_and_the_run_ends_there(tmp_path):
    # evals at steps 2, 4, 6 of 20 problems (as planted): 0.90 (0.70-0.97), then 0.75 (0.53-0.89), which overlaps and
    # passes, then 0.00, which fires; the remedy is stop: the newest that passed is step 4, the best is step 2
    real = recipe.held_out

    def held_out(run, record):
        scores = real(run, record)
        accuracy = {2: 0.9, 4: 0.75}.get(record.step, 0.0)
        low, high = wilson_interval(round(accuracy * 20), 20)
        fake = {"eval/accuracy": accuracy, "eval/accuracy_low": low, "eval/accuracy_high": high}
        for numbers in (scores, record.metrics, run.state.history[-1]):
            numbers.update(fake)
        return scores

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train, "held_out", held_out)
        out = run_cli(["train", *GUARDED, "trainer.max_steps=6", "trainer.guard.heldout_drop.remedy=stop",
                       f"hydra.run.dir={tmp_path}"])
    assert out.returncode == 0, out.stderr[-3000:]
    (decision,) = _decisions(tmp_path)
    assert (decision["step"], decision["remedy"], decision["rewound_to"]) == (6, "stop", 2)
    # the run is at step 2's checkpoint: the files read as a run that stopped there, step 4's checkpoint set aside
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2]
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_000002"]
    assert f"checkpoint: {tmp_path / 'checkpoints' / 'step_000002'}" in out.stderr


class Killed(Exception):
    """A kill -9, as far as the run folder can tell."""


def test_a_run_killed_right_after_a_rewind_resumes_to_the_same_decisions_and_adapter(guarded, tmp_path):
    run, _ = guarded
    calls = []

    def dies_after_the_rewind(run_, n):
        calls.append(n)
        if calls == [1, 2, 3, 4, 3]:  # the first step after the rewind to step 2
            raise Killed
        return recipe.step(run_, n)

    cfg = compose("train", GUARDED)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train, "held_out", planted())
        mp.setattr(train, "step", dies_after_the_rewind)
        with pytest.raises(Killed):
            train.run(cfg, tmp_path)
        assert len(_decisions(tmp_path)) == 1  # the decision is on disk; no checkpoint holds it yet
        mp.setattr(train, "step", recipe.step)
        train.run(compose("train", [*GUARDED, f"resume={tmp_path}"]), tmp_path)
    assert _decisions(tmp_path) == _decisions(run)
    assert [deterministic(r) for r in metrics(tmp_path)] == [deterministic(r) for r in metrics(run)]
    assert _same(_adapter(tmp_path), _adapter(run))


def test_a_run_killed_between_the_set_aside_and_the_decision_redoes_it(guarded, tmp_path):
    run, _ = guarded
    real = guard.write_decision

    def killed(*args):
        raise Killed

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train, "held_out", planted())
        mp.setattr(guard, "write_decision", killed)
        with pytest.raises(Killed):
            train.run(compose("train", GUARDED), tmp_path)
        assert not (tmp_path / "guard.jsonl").exists()
        mp.setattr(guard, "write_decision", real)
        # the resume goes on from step 2 as if nothing fired, reaches step 4 again and fires as the run did
        train.run(compose("train", [*GUARDED, f"resume={tmp_path}"]), tmp_path)
    assert _decisions(tmp_path) == _decisions(run)
    assert _same(_adapter(tmp_path), _adapter(run))


@pytest.mark.parametrize("override, line", [
    ("+trainer.guard.reward_hack={remedy:stop}",
     "error: trainer.guard.reward_hack is not a tripwire; the tripwires are heldout_drop, nonfinite, logp_gap, "
     "entropy or length: drop it"),
    ("trainer.guard.heldout_drop.lr_factor=null",
     "error: trainer.guard.heldout_drop.remedy=lr needs its factor: trainer.guard.heldout_drop.lr_factor (None) must "
     "be a number > 0; set trainer.guard.heldout_drop.lr_factor=0.5"),
])
def test_bad_guard_settings_are_one_line_before_the_model_loads(override, line, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(recipe, "build_policy", refuse)
    out = run_cli(["train", *GUARDED, override, f"hydra.run.dir={tmp_path / 'run'}"])
    assert one_line_error(out) == line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
