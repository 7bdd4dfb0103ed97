"""`grpo train env=tools`: a 2-step tiny run whose episodes call a tool, with completions.jsonl showing the turns, the
tools/ metrics logged, and a user's reward function reading the episode's messages as TRL passes them and scoring
each assistant turn (the per-turn path, `turn_rewards` in completions.jsonl).

What is scripted: the tiny random model never writes a tool call by itself, so the engine's first turn in every
episode is a fixed `<tool_call>` (its ids enter the episode as if sampled); every later turn is the model's own,
sampled by HF generate after the tool's result.
"""

from __future__ import annotations

import json

import pytest

from grpo_cli import recipe
from grpo_cli.commands import evaluate, sample
from tests.helpers.cli import one_line_error, run_cli
from tests.helpers.runs import EVAL_TINY, TINY, metrics
from tests.helpers.tools import MULTIPLY_TOOL, first_turn_calls

MY_TOOLS = MULTIPLY_TOOL + '''

def saw_a_tool_turn(prompts, completions, tool_call_count, **kwargs):
    # completions as TRL passes a multi-turn episode: the assistant and tool messages; scored per turn, the
    # score on the last assistant turn
    scores = []
    for c, n in zip(completions, tool_call_count):
        turns = sum(m["role"] == "assistant" for m in c)
        scores.append([0.0] * (turns - 1) + [float(c[1]["role"] == "tool" and c[1]["content"] == "12" and n == 1)])
    return scores
'''


def test_a_run_with_tools_logs_turns_and_tool_metrics(tmp_path, monkeypatch):
    (tmp_path / "episode_tools.py").write_text(MY_TOOLS)
    first_turn_calls(monkeypatch)
    out = tmp_path / "run"
    code, _, err = run_cli(["train", *TINY[:-2], "trainer.max_steps=2", f"hydra.run.dir={out}", "env=tools",
                            "env.tools=[episode_tools.multiply]", "env.max_episode_tokens=100", "env.max_turns=2",
                            "reward=custom", "reward.funcs=[episode_tools.saw_a_tool_turn]",
                            "trainer.log_completions_every=1", "trainer.num_completions_to_print=2"], cwd=tmp_path)
    assert code == 0, err
    # the console's table shows each episode turn by turn: the call as the model wrote it, the tool's result on a
    # line of its own, each assistant turn's reward after it (not the decoded ids' bare "tool"/"assistant" words)
    assert err.count("[multiply] -> 12") == 2 * 2  # 2 rows shown per step, 2 steps
    assert err.count("</tool_call> [+0.00]") == err.count("[+1.00]") == 2 * 2
    assert "\ntool\n" not in err.replace("│", "").replace(" ", "")
    records = metrics(out)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        # one call per episode, none failed; the environment's tokens are a share of every completion
        assert r["tools/call_frequency"] == 1.0 and r["tools/failure_frequency"] == 0.0
        assert 1.0 < r["turns/mean"] <= 2.0 and 0 < r["tokens/environment_share"] < 1
        assert r["reward"] == 1.0  # the reward function read the tool turn and the call count
    lines = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert len(lines) == 2 * 2 * 4  # 2 steps x 2 prompts x G=4
    turns = lines[0]["turns"]
    assert turns[0]["tool_calls"][0]["function"] == {"name": "multiply", "arguments": {"a": 4, "b": 3}}
    assert turns[1] == {"role": "tool", "name": "multiply", "content": "12"}
    assert turns[2]["role"] == "assistant" and lines[0]["tool_calls"] == 1
    # the per-turn rewards, one per assistant turn, and their sum as the episode's reward
    assert all(len(line["turn_rewards"]) == len([m for m in line["turns"] if m["role"] == "assistant"])
               and line["turn_rewards"][-1] == line["reward"] == 1.0 for line in lines)


# a Gemma-like chat template: its own turn markers, tools ignored
GEMMA_TEMPLATE = ("{%- for m in messages %}{{- '<start_of_turn>' + m.role + '\\n' + m.content + '<end_of_turn>\\n' }}"
                  "{%- endfor %}{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}")


@pytest.mark.parametrize("command", ["train", "eval", "sample"])
@pytest.mark.parametrize("setting, expected", [
    # the tiny model's ChatML template ignores tools
    ("env.tool_format=template", "env.tool_format=template, but the model's chat template ignores tools"),
    # auto on a template that is neither: no format fits it (ChatML turns the template never writes)
    ("data.chat_template=gemma.jinja", "env.tool_format=auto: the chat template ignores tools and is not ChatML"),
], ids=["template-ignores-tools", "auto-on-gemma"])
def test_a_tool_format_that_does_not_fit_the_template_stops_before_the_model_loads(tmp_path, monkeypatch, command,
                                                                                   setting, expected):
    (tmp_path / "episode_tools.py").write_text(MY_TOOLS)
    (tmp_path / "gemma.jinja").write_text(GEMMA_TEMPLATE)
    for module, name in ((recipe, "build_policy"), (evaluate, "inference_policy"), (sample, "inference_policy")):
        monkeypatch.setattr(module, name, lambda *_: pytest.fail("the model loaded"))
    base = [*TINY[:-2], "trainer.max_steps=1"] if command == "train" else [*EVAL_TINY, "eval.limit=1"] \
        if command == "eval" else [*EVAL_TINY, "sample.num_prompts=1"]
    line = one_line_error(run_cli([command, *base, "env=tools", "env.tools=[episode_tools.multiply]", setting,
                                   f"hydra.run.dir={tmp_path / 'out'}"], cwd=tmp_path))
    assert expected in line, line
