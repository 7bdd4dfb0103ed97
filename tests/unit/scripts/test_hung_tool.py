"""scripts/hung_tool.py's reading of its runs and its claim, on run folders written by hand (the measurement itself
runs on the real model, on a quiet machine)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.scripts import load_script

hung_tool = load_script("hung_tool")


def fake_run(out, name: str, times: list[float], children: list[tuple[int, int, bool]], hang_at: float | None,
             speed: list[float] | None = None):
    """OUT/NAME: metrics.jsonl with each step's time/step_s (and tokens_per_s, `speed`), procs.jsonl with a sample
    (steps logged, descendants, whether one was busy) a second from t=1000, and hang_started holding `hang_at`."""
    run = out / name
    run.mkdir(parents=True)
    records = [{"step": i + 1, "time/step_s": t} | ({"tokens_per_s": speed[i]} if speed else {})
               for i, t in enumerate(times)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    samples = [{"t": 1000.0 + i, "steps": steps, "children": n, "trainer_cpu": 190.0,
                "busy": [[7, "python", 99.0]] if busy else []} for i, (steps, n, busy) in enumerate(children)]
    (run / "procs.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    if hang_at is not None:
        (run / "hang_started").write_text(str(hang_at))


# samples: (steps logged, descendants, busy); the hung run's spin begins at t=1002.5, after the sample at t=1002
# (2 steps logged): its step is 3, and steps 4-5 are compared
PLAIN = [(0, 2, False), (1, 2, False), (2, 2, False), (3, 2, False), (4, 2, False)]
HUNG = [(0, 2, False), (1, 2, False), (2, 2, False), (2, 3, True), (3, 2, False), (4, 2, False)]


def test_later_steps_within_a_tenth_and_no_busy_descendant_hold(tmp_path):
    fake_run(tmp_path, "plain_r1", [90, 90, 90, 90, 90], PLAIN, None, speed=[30, 30, 30, 40, 40])
    # steps 4-5: (95 + 94) / 2 = 94.5 against 90: 1.050; tokens/s (38 + 38) / 2 = 38 against 40: 0.950
    fake_run(tmp_path, "hung_r1", [90, 90, 104, 95, 94], HUNG, 1002.5, speed=[30, 30, 20, 38, 38])
    text = hung_tool.report(tmp_path)
    assert text.startswith("hang in step [3] (the step in which the spinning call began); steps compared: 4 on")
    row = next(line for line in text.splitlines() if line.startswith("| hung_r1 "))
    # steps 1-2 90.0; the hang's step 104.0; later 94.5; ratio 1.050; descendants before the hang (samples with
    # fewer than 2 steps logged: 2, 2) / after it (3 and 4 steps logged: 2, 2), max 3; no busy sample after
    assert row == "| hung_r1 | 90.0 | 104.0 | 94.5 | 1.050 | 2 / 2; 3 | 0 | 190 | 38.0, 0.950 |"
    assert text.rstrip().endswith("holds (1 of 1 rounds within 10%, no busy descendant, descendants back to the "
                                  "plain arm's)")


@pytest.mark.parametrize("times, samples", [
    ([90, 90, 104, 100, 99], HUNG),  # (100 + 99) / 2 / 90 = 1.106: past 10%
    ([90, 90, 104, 95, 94], [*HUNG[:4], (3, 3, True), (4, 3, True), (4, 3, True)]),  # a busy worker stays on
])
def test_a_slower_later_step_or_a_descendant_left_busy_does_not_hold(tmp_path, times, samples):
    fake_run(tmp_path, "plain_r1", [90, 90, 90, 90, 90], PLAIN, None)
    fake_run(tmp_path, "hung_r1", times, samples, 1002.5)
    assert "does not hold (0 of 1 rounds" in hung_tool.report(tmp_path)
