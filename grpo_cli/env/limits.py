"""An episode's limits and a tool call's, read from the `env` section, and their checks (conf/env/*.yaml holds the
values; grpo_cli.env.episode says how each is counted)."""

from __future__ import annotations

from dataclasses import dataclass

from grpo_cli.checks import Rule, is_int, is_num

FORMATS = ("auto", "template", "chatml")


@dataclass(frozen=True)
class Limits:
    """An episode's limits and a call's, read from the `env` section (conf/env/*.yaml holds their values)."""

    max_turns: int
    max_tool_calls: int
    max_episode_tokens: int
    tool_timeout_s: float
    max_result_chars: int


CHECKS = [
    Rule("env.max_turns", lambda v: is_int(v) and v >= 1,
         "must be an integer >= 1: the model's turns per episode (1: one answer, no tool result read); "
         "set env.max_turns=4"),
    Rule("env.max_tool_calls", lambda v: is_int(v) and v >= 0,
         "must be an integer >= 0: tool calls run per episode; set env.max_tool_calls=8"),
    Rule("env.max_episode_tokens", lambda v: is_int(v) and v >= 1,
         "must be an integer >= 1: the tokens after the prompt, sampled and added; set env.max_episode_tokens=512"),
    Rule("env.tool_timeout_s", lambda v: is_num(v) and v > 0,
         "must be a number of seconds > 0; set env.tool_timeout_s=10"),
    Rule("env.max_result_chars", lambda v: is_int(v) and v >= 1,
         "must be an integer >= 1: a tool result's characters the model reads; set env.max_result_chars=1000"),
    Rule("env.tool_format", lambda v: v in FORMATS, "must be auto, template or chatml; set env.tool_format=auto"),
]
