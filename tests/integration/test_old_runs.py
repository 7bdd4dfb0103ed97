"""Old run folders: a run saved by an earlier grpo-cli resumes and evaluates today.

tests/data/old_runs/ holds a run folder as `grpo train` saved it on 2026-12-06 (tests.helpers.runs.TINY, one step: its
checkpoint's files, metrics.jsonl) and that run's config with the keys added to grpo-cli over time deleted
(older_config.yaml, whose header names them). runs.upgrade fills what a saved config lacks from the YAML of the run's
group option, in the one place every command reads a run folder (runs.read_saved)."""

from __future__ import annotations

import shutil

from omegaconf import OmegaConf

from grpo_cli import checkpoint
from grpo_cli.config import compose
from tests.helpers import REPO
from tests.helpers.cli import run_cli
from tests.helpers.runs import copy_run, deterministic, eval_rows, metrics

OLD_RUNS = REPO / "tests" / "data" / "old_runs"
SAVED = OLD_RUNS / "2026-12-06"
OLDER = OLD_RUNS / "older_config.yaml"
STEP_1 = "checkpoints/step_000001"


def _leaves(node, prefix: str = "") -> dict[str, object]:
    """{dotted key: value} of a config's leaves; an empty mapping is a leaf (data.chat_template_kwargs: {})."""
    plain = OmegaConf.to_container(node) if OmegaConf.is_config(node) else node
    if not isinstance(plain, dict) or (not plain and prefix):
        return {prefix.rstrip("."): plain}
    return {k: v for key, value in plain.items() for k, v in _leaves(value, f"{prefix}{key}.").items()}


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


def test_a_run_older_than_its_keys_resumes_with_them_filled_and_trains_as_todays(tmp_path):
    """The older config lacks keys that today's YAML holds: the resumed run saves them with its group option's values,
    and its step 2 is today's run's step 2 number for number."""
    today = copy_run(SAVED, tmp_path / "today")
    older = copy_run(SAVED, tmp_path / "older")
    shutil.copy(OLDER, older / STEP_1 / "config.yaml")
    # the 2026-12-06 run set these two (tests.helpers.runs.TINY); a run without them takes the YAML's, so this resume
    # sets them as that run did (a key newer than the run may be given on resume)
    off = ["trainer.guard=null", "trainer.eval_every=null"]
    assert deterministic(_resume_and_eval(older, tmp_path / "a", *off)[1]) == \
        deterministic(_resume_and_eval(today, tmp_path / "b")[1])
    # every key the older run lacked is saved with the step-2 checkpoint, as the 2026-12-06 run saved it
    saved = _leaves(checkpoint.load_config(SAVED / STEP_1))
    resumed = _leaves(checkpoint.load_config(older / "checkpoints/step_000002"))
    lacked = sorted(set(saved) - set(_leaves(OmegaConf.load(OLDER))))
    assert len(lacked) == 22  # as older_config.yaml's header lists them
    assert {k: resumed.get(k, "absent") for k in lacked} == {k: saved[k] for k in lacked}
    # and the YAML of its group option is where they come from: the 2026-12-06 run set none of them
    todays_yaml = _leaves(compose("train", ["model=tiny"]))
    assert {k: todays_yaml[k] for k in lacked if not k.startswith("trainer.")} == \
        {k: saved[k] for k in lacked if not k.startswith("trainer.")}
