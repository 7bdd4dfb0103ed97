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
