"""Old run folders: a run saved by an earlier grpo-cli resumes and evaluates today.

tests/data/old_runs/ holds a run folder as `grpo train` saved it on 2026-12-06 (tests.helpers.TINY, one step: its
checkpoint's files, metrics.jsonl) and that run's config with the keys added to grpo-cli over time deleted
(older_config.yaml, whose header names them). runs.upgrade fills what a saved config lacks from the YAML of the run's
group option, in the one place every command reads a run folder (runs.read_saved)."""

from __future__ import annotations

from tests.helpers import REPO, copy_run, eval_rows, metrics, run_cli

OLD_RUNS = REPO / "tests" / "data" / "old_runs"
SAVED = OLD_RUNS / "2026-12-06"
STEP_1 = "checkpoints/step_000001"



def _resume_and_eval(run, tmp_path, *overrides: str) -> list[dict]:
    """`grpo train resume=RUN` one more step, then `grpo eval` of the step it resumed from; the run's metrics."""
    code, _, err = run_cli(["train", f"resume={run}", "trainer.max_steps=2", *overrides])
    assert code == 0, err[-3000:]
    out = tmp_path / "eval"
    code, _, err = run_cli(["eval", f"checkpoint={run}/{STEP_1}", "eval.limit=2", f"hydra.run.dir={out}"])
    assert code == 0, err[-3000:]
    assert len(eval_rows(out)) == 2
    return metrics(run)


def test_a_run_saved_on_2026_12_06_resumes_and_evaluates(tmp_path):
    run = copy_run(SAVED, tmp_path / "run")
    records = _resume_and_eval(run, tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    # the step it resumed from stays as the run wrote it
    assert records[0] == metrics(SAVED)[0]
