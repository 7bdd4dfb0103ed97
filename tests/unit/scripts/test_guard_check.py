"""scripts/guard_check.py's kill stage: when it kills a guarded run (during the first eval after the fault, right
after the first rewind), on run folders written by hand (the runs themselves are the real model's)."""

from __future__ import annotations

import json
import os
import time

from tests.helpers.scripts import load_script

guard_check = load_script("guard_check")


def run_folder(tmp_path, steps: int, logged_ago: float, eval_every: int = 10):
    """A run that has logged steps 1..`steps` (40 s each; step 10 with a 30 s eval), the last `logged_ago` s ago."""
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text(f"trainer:\n  max_steps: 40\n  eval_every: {eval_every}\n")
    rows = [{"step": s, "time/step_s": 40.0} | ({"time/eval_s": 30.0} if s == 10 else {}) for s in range(1, steps + 1)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    then = time.time() - logged_ago
    os.utime(run / "metrics.jsonl", (then, then))
    return run


def test_the_first_eval_after_the_fault_is_the_next_multiple_of_eval_every(tmp_path):
    # the fault from update 15: with evals every 10 steps the first after it is step 20's; every 4: step 16's
    assert guard_check.first_eval_after_fault(run_folder(tmp_path, 1, 0)) == 20
    assert guard_check.first_eval_after_fault(run_folder(tmp_path / "b", 1, 0, eval_every=4)) == 16


def test_the_eval_kill_waits_for_step_19_then_a_step_and_a_quarter_of_an_eval(tmp_path):
    # step 19 logged; the wait is the last 5 steps' median, 40 s, plus a quarter of the step-10 eval's 30 s: 47.5 s
    assert guard_check.kill_moment(run_folder(tmp_path / "a", 19, 45), "eval") is None
    seen = guard_check.kill_moment(run_folder(tmp_path / "b", 19, 50), "eval")
    assert (seen["step"], seen["wait_s"]) == (20, 47.5) and seen["seen"].startswith("step 19 logged 47.5 s ago")
    # another step last logged: not yet, or past it (and then `passed` says so, so the script stops waiting)
    assert guard_check.kill_moment(run_folder(tmp_path / "c", 18, 600), "eval") is None
    assert not guard_check.passed(tmp_path / "c" / "run", "eval")
    assert guard_check.kill_moment(run_folder(tmp_path / "d", 20, 600), "eval") is None
    assert guard_check.passed(tmp_path / "d" / "run", "eval")


def test_the_rewind_kill_waits_for_the_first_decision(tmp_path):
    run = run_folder(tmp_path, 20, 0)
    assert guard_check.kill_moment(run, "rewind") is None
    (run / "guard.jsonl").write_text("")
    assert guard_check.kill_moment(run, "rewind") is None
    decision = {"step": 20, "tripwire": "heldout_drop", "rewound_to": 10, "remedy": "lr"}
    (run / "guard.jsonl").write_text(json.dumps(decision) + "\n")
    assert guard_check.kill_moment(run, "rewind") == {"seen": "guard.jsonl's first decision", "decision": decision}


def finished_run(folder, guard: list[dict], scale: float = 1.0):
    """A guarded or unguarded run at its end: 40 steps logged with evals at 10-40, a checkpoint with an adapter."""
    import torch
    from safetensors.torch import save_file

    (folder / "checkpoints" / "step_000040").mkdir(parents=True)
    save_file({"a": torch.ones(2, 2) * scale, "b": torch.arange(3.0)},
              str(folder / "checkpoints" / "step_000040" / "adapter_model.safetensors"))
    evals = {s: {"time/eval_s": 30.0, "eval/accuracy": 0.6 - s / 100, "eval/accuracy_low": 0.5 - s / 100,
                 "eval/accuracy_high": 0.7 - s / 100} for s in (10, 20, 30, 40)}
    rows = [{"step": s, "time/step_s": 40.0, "loss": 0.1 * s, "reward": 0.5} | evals.get(s, {}) for s in range(1, 41)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "guard.jsonl").write_text("".join(json.dumps(d) + "\n" for d in guard))


def test_results_outlive_the_run_folders_and_the_kill_compares_digests(monkeypatch, tmp_path, capsys):
    """A new session starts on a fresh machine: the skip, the report and the kill's comparison read OUT/results
    only, so run folders (weights) may be gone; the adapter comparison goes through a digest of its tensors."""
    import shutil

    trained = []
    monkeypatch.setattr(guard_check, "train_or_resume", lambda run, *a, **k: trained.append(run.name))
    draw = guard_check.curves
    monkeypatch.setattr(guard_check, "curves", lambda out, seeds: None)  # the report's: drawn below, once
    decision = {"step": 20, "tripwire": "heldout_drop", "values": {"accuracy": 0.1}, "rewound_to": 10, "remedy": "lr"}
    finished_run(tmp_path / "runs" / "unguarded_seed0", [])
    finished_run(tmp_path / "runs" / "guarded_seed0", [decision])
    for arm in guard_check.ARMS:
        guard_check.train(tmp_path, arm, 0, [])
    shutil.rmtree(tmp_path / "runs")
    for arm in guard_check.ARMS:
        guard_check.train(tmp_path, arm, 0, [])  # skipped: the results are there
    assert trained == []
    guard_check.report(tmp_path, [0])
    out = capsys.readouterr().out
    # B = step 10's 0.50, U = step 40's 0.20 (interval 0.10-0.30, wholly below B's 0.40-0.60), G = 0.20
    assert "| 0 | 0.500 | 0.200 | 0.200 (40) | step 20: heldout_drop -> lr | True | True | False |" in out
    # the curves: both arms' kept evals, the gate's firing (from guard.jsonl) and the end, from the results alone
    draw(tmp_path, [0])
    assert (tmp_path / "curves.png").stat().st_size > 0
    # a killed run with the same tensors has the same digest; another tensor does not
    for name, scale in (("killed_eval_seed0", 1.0), ("killed_rewind_seed0", 2.0)):
        finished_run(tmp_path / "runs" / name, [decision], scale)
        guard_check.save_result(tmp_path, tmp_path / "runs" / name,
                                kill={"seen": "x", "last_checkpoint": "step_000010", "step": 20, "wait_s": 1.0})
    # the rewind-killed process logged step 7 with another loss before the kill (an engine that differs between
    # processes): the steps before the kill show it, naming the first step that differs
    saved = guard_check.result(tmp_path, "killed_rewind_seed0")
    saved["metrics"][6]["loss"] += 1e-9
    guard_check.write_json(tmp_path / "results" / "killed_rewind_seed0.json", saved)
    guard_check.kill_report(tmp_path, [0])
    eval_row, rewind_row = capsys.readouterr().out.strip().splitlines()[-2:]
    # the kill at 1.0 s fell inside step 20's update (40 s), not its eval; decisions equal; adapters: equal, not
    assert eval_row.startswith("| 0 | eval | x; the resumed step 20 took 40.0 s") and "outside the eval" in eval_row
    assert eval_row.endswith("| True (steps 1-10) | True | step_000040 vs step_000040 | True |")
    assert rewind_row.endswith("| False (first at step 7) | True | step_000040 vs step_000040 | False |")


def test_the_kill_report_says_when_a_later_rewind_set_the_killed_step_aside(tmp_path, capsys):
    # the run stopped at step 8 after the kill in step 16's eval: its kept record ends at step 8
    rows = [{"step": s, "loss": 0.1 * s, "reward": 0.5} for s in range(1, 9)]
    decision = {"step": 16, "tripwire": "heldout_drop", "values": {"accuracy": 0.04}, "rewound_to": 8, "remedy": "lr"}
    whole = {"run": "guarded_seed0", "metrics": rows, "guard": [decision], "last_checkpoint": "step_000008",
             "adapter_sha256": "x"}
    guard_check.write_json(tmp_path / "results" / "guarded_seed0.json", whole)
    for when in ("eval", "rewind"):
        kill = {"seen": "seen", "last_checkpoint": "step_000008", "step": 16, "wait_s": 20.0}
        guard_check.write_json(tmp_path / "results" / f"killed_{when}_seed0.json", {**whole, "kill": kill})
    guard_check.kill_report(tmp_path, [0])
    eval_row = capsys.readouterr().out.strip().splitlines()[2]
    assert "the resumed step 16 was set aside by a later rewind" in eval_row
    assert eval_row.endswith("| True (steps 1-8) | True | step_000008 vs step_000008 | True |")
