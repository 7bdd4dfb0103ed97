"""`grpo eval env=tools` and `grpo sample env=tools`: episodes run as train runs them (the same EpisodeSampler and
tool format), the rewards read the episodes' calls, and eval's completions file and sample's output show the turns.

What is scripted, as in test_training_with_tools.py: the tiny random model never writes a tool call, so each
episode's first turn is a fixed call of multiply(4, 3); every later turn is the model's own.
"""

from __future__ import annotations

import json

from tests.helpers.cli import run_cli
from tests.helpers.runs import EVAL_TINY
from tests.helpers.tools import MULTIPLY_TOOL, first_turn_calls

EVAL_TOOLS = MULTIPLY_TOOL + '''

def called_once(prompts, completions, tool_call_count, **kwargs):
    # the episode's messages and its call count, as train passes them
    return [float(c[1] == {"role": "tool", "name": "multiply", "content": "12"} and n == 1)
            for c, n in zip(completions, tool_call_count)]
'''
ENV = ["env=tools", "env.tools=[eval_tools.multiply]", "env.max_episode_tokens=100", "env.max_turns=2",
       "reward=custom", "reward.funcs=[eval_tools.called_once]"]
CALLED = {"name": "multiply", "arguments": {"a": 4, "b": 3}}


def test_eval_runs_episodes_and_its_completions_show_the_turns(tmp_path, monkeypatch):
    (tmp_path / "eval_tools.py").write_text(EVAL_TOOLS)
    first_turn_calls(monkeypatch)
    out = tmp_path / "eval"
    code, _, err = run_cli(["eval", *EVAL_TINY, *ENV, "eval.limit=2", "eval.num_samples=2", "eval.k=[1,2]",
                            f"hydra.run.dir={out}"], cwd=tmp_path)
    assert code == 0, err
    rows = [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(len(row["samples"]) == 2 for row in rows)
    for completion in [c for row in rows for c in (row["greedy"], *row["samples"])]:
        assert completion["turns"][0]["tool_calls"][0]["function"] == CALLED
        assert completion["turns"][1] == {"role": "tool", "name": "multiply", "content": "12"}
        assert completion["turns"][2]["role"] == "assistant"  # the model's own turn after the result
        assert completion["tool_calls"] == 1 and completion["reward"] == 1.0
    assert json.loads((out / "eval.json").read_text())["results"][0]["mean_reward"] == 1.0


def test_sample_runs_episodes_and_shows_the_turns(tmp_path, monkeypatch):
    (tmp_path / "eval_tools.py").write_text(EVAL_TOOLS)
    first_turn_calls(monkeypatch)
    out = tmp_path / "samples.jsonl"
    code, _, err = run_cli(["sample", *EVAL_TINY, *ENV, "sample.num_prompts=1", "sample.n=2", f"sample.output={out}",
                            f"hydra.run.dir={tmp_path / 'sample'}"], cwd=tmp_path)
    assert code == 0, err
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 2
    for record in records:
        assert record["turns"][0]["tool_calls"][0]["function"] == CALLED
        assert record["turns"][1] == {"role": "tool", "name": "multiply", "content": "12"}
        assert record["tool_calls"] == 1 and record["reward"] == 1.0
    assert err.count("[multiply] -> 12") == 2  # each panel shows the tool's result as a turn of its own
