"""`grpo train reward=judge`: a real chat endpoint on localhost scores the completions; the replies it cannot read
count as no score in the metrics, and the key goes to the server, never to the run folder."""

from __future__ import annotations

import json

import pytest

from tests.helpers.cli import one_line_error, run_cli
from tests.helpers.judge import JudgeServer, chat_reply
from tests.helpers.runs import TINY

KEY = "sk-judge-secret-4242"


def test_a_run_with_the_judge_reward(tmp_path):
    # every second request gets a reply with no number in it: 4 of the 8 completions (2 prompts x G=4) get no score
    def reply(n, body):
        return 200, chat_reply("Score: 7" if n % 2 == 0 else "no idea"), 0.0

    run = tmp_path / "run"
    with JudgeServer(reply) as server:
        code, _, err = run_cli(["train", *TINY, "trainer.max_steps=1", "sampler=default", "reward=judge",
                                f"reward.functions.judge.base_url={server.url}", "reward.functions.judge.model=m",
                                "reward.functions.judge.api_key_env=JUDGE_RUN_KEY", f"hydra.run.dir={run}"],
                               cwd=tmp_path, env={"JUDGE_RUN_KEY": KEY})
    assert code == 0, err
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert record["rewards/judge/mean"] == pytest.approx(0.7) and record["rewards/judge/no_score"] == 4
    assert len(server.requests) == 8 and {r["authorization"] for r in server.requests} == {f"Bearer {KEY}"}
    files = [p for p in run.rglob("*") if p.is_file()]
    assert files and not [p for p in files if KEY.encode() in p.read_bytes()]
    saved = (run / "checkpoints" / "step_000001" / "config.yaml").read_text()
    assert "api_key_env: JUDGE_RUN_KEY" in saved                  # the variable's name is what the run keeps


def test_an_unset_key_variable_stops_before_the_model_loads(tmp_path, no_model):
    line = one_line_error(run_cli(["train", *TINY, "reward=judge", "reward.functions.judge.model=m",
                                   "reward.functions.judge.api_key_env=JUDGE_UNSET_KEY", f"hydra.run.dir={tmp_path}"],
                                  cwd=tmp_path))
    assert line.startswith("error: reward.functions.judge.api_key_env names JUDGE_UNSET_KEY, which is not set")
