"""examples/guess_number on the tiny random model, one training step: the game class (env=class), its rows without
prompts (data=env, data/), and the reward that reads the environment, as the example's driver passes them. The tiny
model never writes a call by itself: every episode's first turn is a scripted guess(8) (tests.helpers.
first_turn_calls), so an episode is won exactly when its row's secret is 8."""

from __future__ import annotations

import json

from tests.helpers import REPO
from tests.helpers.cli import run_cli
from tests.helpers.runs import TINY, metrics
from tests.helpers.tools import first_turn_calls

HERE = REPO / "examples" / "guess_number"
GUESS_8 = '<tool_call>\n{"name": "guess", "arguments": {"n": 8}}\n</tool_call>'


def test_the_game_and_its_reward_train_one_step(tmp_path, monkeypatch):
    first_turn_calls(monkeypatch, GUESS_8)
    out = tmp_path / "run"
    # 8 of the 15 secrets a step (8 prompts x G=2); 120 tokens: the scripted call (63 of the character tokenizer), its
    # result and a few of the random model's own
    code, _, err = run_cli(["train", *TINY[:-2], "trainer.max_steps=1", "trainer.prompts_per_step=8",
                            "algo.group_size=2", "trainer.micro_batch_size=16", "trainer.log_completions_every=1",
                            f"hydra.run.dir={out}", "data=env", f"data.path={HERE / 'data'}", "env=class",
                            "env.factory=guess_game.GuessNumber", "env.max_turns=5", "env.max_episode_tokens=120",
                            "sampler.max_prompt_tokens=1600", "reward=custom", "reward.funcs=[won_reward.won]"],
                           cwd=HERE)
    assert code == 0, err
    [record] = metrics(out)
    assert record["tools/call_frequency"] >= 1.0  # every episode made the scripted guess
    lines = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert len(lines) == 16
    # the reward read each episode's game: 1 where the row's secret is 8, whatever the model wrote after
    assert all(line["reward"] == float(json.loads(line["question"])["secret"] == 8) for line in lines)
    assert record["reward"] == sum(line["reward"] for line in lines) / 16
