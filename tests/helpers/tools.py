"""Users' files for the tool and reward tests, as the source text a test writes into a user's folder (TRL's accuracy
reward, the multiply tool, the scripted sampler of a torchrun run), and `first_turn_calls`, which makes every
episode of this process's HF generate call the tool first (tests.helpers.scripted_tools)."""

from __future__ import annotations

import inspect
from pathlib import Path

from grpo_cli.rollout.hf import HFSampler
from tests.helpers import scripted_tools
from tests.helpers.scripted_tools import TOOL_CALL, FirstTurnCalls

# TRL's documented accuracy reward, written from its contract (`accuracy_reward(completions, solution, **kwargs)`,
# conversational completions, math_verify's parse and verify with their defaults, whose timeouts refuse to run off
# the main thread): 1.0 when the completion's answer equals the solution, None when the solution does not parse
TRL_ACCURACY = '''
from math_verify import parse, verify

def accuracy_reward(completions, solution, **kwargs):
    scores = []
    for completion, answer in zip(completions, solution):
        gold = parse(answer)
        scores.append(float(verify(gold, parse(completion[0]["content"]))) if gold else None)
    return scores
'''

# a typed, documented tool (what env.tools needs), as the source of a user's tool file
MULTIPLY_TOOL = "\n" + inspect.getsource(scripted_tools.multiply)

# the user's file of a run in processes of its own (torchrun), written to its folder as scripted_tools.py
SCRIPTED_TOOLS = Path(scripted_tools.__file__).read_text()
SCRIPTED_TOOLS_ARGS = ["sampler=short", "sampler._target_=scripted_tools.Sampler", "env=tools",
                       "env.tools=[scripted_tools.multiply]", "env.max_episode_tokens=100", "env.max_turns=2"]


def first_turn_calls(monkeypatch, tool_call: str = TOOL_CALL) -> None:
    """HF generate's episodes engine, except that a sequence with no `tool_call` yet is continued with `tool_call` and
    EOS (its ids enter the episode as if sampled); every later turn is the model's own."""
    engine = type("FirstTurnCalls", (FirstTurnCalls,), {"call": tool_call})
    monkeypatch.setattr(HFSampler, "engine", lambda self, policy, tokenizer, *, greedy, generator, temperature=None:
                        engine(self, policy, tokenizer, greedy, generator, temperature))
