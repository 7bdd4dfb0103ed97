"""Tools of a multi-turn episode: the user's functions named in `env.tools`, their JSON schemas, and one call run
under a timeout, its result (or its error) turned into the text the model reads back.

    grpo train env=tools 'env.tools=[my_tools.calculator,path/to/tools.py:search]'

A tool is a plain function, sync or `async def`, with a type hint on every parameter and a Google-style docstring
(a description, then an `Args:` line per parameter). transformers' `get_json_schema` turns it into the schema that
chat templates and TRL read, and refuses anything less; such a tool stops the run before the model loads, with one
line naming the fix. Names resolve as reward functions' do (grpo_cli.rewards.user.load_function): `module.fn`
with the working directory first on sys.path, or `path/to/file.py:fn`.

During an episode a call goes as it goes in TRL's GRPOTrainer (its tool loop, trl/trainer/grpo_trainer.py): a
function that raises, or a name that is no tool, gets `{'error': '...'}` back as its result and counts as a
failure; a result that is not a string is converted with `str()` (a dict reads as its repr, None as "None"), not
refused. Two limits TRL does not set: a call still running after `env.tool_timeout_s` gets an error result (its
thread is left to finish on its own: Python cannot stop a thread), and a result longer than `env.max_result_chars`
is cut, with a note saying how much the model sees; both count as failures.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transformers.utils import get_json_schema

from grpo_cli.env.limits import Limits
from grpo_cli.errors import ConfigError
from grpo_cli.rewards.user import BUILTINS, load_function

HOW = ("a tool needs a type hint on every parameter and a docstring with a description and an Args: line per "
       "parameter (transformers' get_json_schema reads them)")


@dataclass(frozen=True)
class Tool:
    """A callable the model may call by `name`; `schema` is what the prompt shows it."""

    name: str
    fn: Callable
    schema: dict


@dataclass(frozen=True)
class ToolCall:
    """One call parsed from the model's text: `error` is set when it could not be read (bad JSON, no name)."""

    name: str
    arguments: Any = None
    error: str | None = None


@dataclass(frozen=True)
class ToolResult:
    """What goes back to the model in a `tool` turn, and whether the call counts as a failure."""

    name: str
    text: str
    failed: bool


def schema_of(fn: Callable, where: str) -> dict:
    """transformers' JSON schema of `fn`, or one line naming what to add."""
    try:
        return get_json_schema(fn)
    except Exception as err:  # DocstringParsingException, TypeHintParsingException, or a hint it cannot map
        raise ConfigError(f"{where}: {err}; {HOW}") from None


def tool_from(fn: Callable, where: str) -> Tool:
    schema = schema_of(fn, where)
    return Tool(schema["function"]["name"], fn, schema)


def load_tools(specs: Any) -> list[Tool]:
    """The tools named in `env.tools`, each checked for a schema; one ConfigError line for the first bad one."""
    specs = [specs] if isinstance(specs, str) else list(specs or [])
    if not specs:
        raise ConfigError("env.tools is empty; name at least one function: 'env.tools=[my_tools.calculator]' or "
                          "'env.tools=[path/to/tools.py:calculator]'")
    tools: list[Tool] = []
    for i, spec in enumerate(specs):
        where = f"env.tools[{i}] ({spec})"
        if isinstance(spec, str) and spec.strip() in BUILTINS:
            raise ConfigError(f"{where} is a built-in reward, not a tool; name your function as module.function or "
                              f"path/to/file.py:function")
        try:
            _, fn = load_function(spec, f"env.tools[{i}]")
        except ConfigError as err:  # the shared resolver names reward.funcs in its fixes
            raise ConfigError(str(err).replace("reward.funcs", "env.tools")) from None
        tool = tool_from(fn, where)
        if any(t.name == tool.name for t in tools):
            raise ConfigError(f"{where}: a second tool named {tool.name!r}; the model calls tools by name, so give "
                              f"each function its own name")
        tools.append(tool)
    return tools


@dataclass
class Toolbox:
    """The tools one episode may call (for `env=class`, its environment's methods) and the instance behind them."""

    tools: dict[str, Tool]
    # the environment instance of `env=class` (reward functions read it); None for plain tools
    environment: Any = None
    schemas: list[dict] = field(init=False)

    def __post_init__(self):
        self.schemas = [t.schema for t in self.tools.values()]

    def call(self, call: ToolCall, timeout_s: float, max_chars: int) -> ToolResult:
        """Run one parsed call; never raises, never waits longer than `timeout_s`."""
        if call.error is not None:
            return ToolResult(call.name, _error(call.error), True)
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(self.tools) or "none"
            return ToolResult(call.name, _error(f"no tool named {call.name!r} (the tools: {known})"), True)
        if not isinstance(call.arguments, dict):
            return ToolResult(call.name, _error(f"the arguments of {call.name} must be a JSON object, got "
                                                f"{json.dumps(call.arguments)}"), True)
        value, error = run_with_timeout(tool.fn, call.arguments, timeout_s)
        if error is not None:
            return ToolResult(call.name, _error(error), True)
        try:
            text = value if isinstance(value, str) else str(value)
        except Exception as err:
            return ToolResult(call.name, _error(f"its result could not be turned into text: {err}"), True)
        if len(text) > max_chars:
            note = f"\n[cut: the first {max_chars} of {len(text)} characters]"
            return ToolResult(call.name, text[:max_chars] + note, True)
        return ToolResult(call.name, text, False)


def _error(message: str) -> str:
    # TRL's shape: the result is {"error": message}, read back as its str()
    return str({"error": message})


def run_with_timeout(fn: Callable, arguments: dict, timeout_s: float) -> tuple[Any, str | None]:
    """(the value `fn(**arguments)` returns, None) or (None, the error as text); an `async def` tool's coroutine
    runs on its own event loop in the same worker thread."""
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            out = fn(**arguments)
            box["value"] = asyncio.run(out) if inspect.iscoroutine(out) else out
        except BaseException as err:  # a library's sys.exit() is a failed call too, not the end of the run
            box["error"] = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__

    worker = threading.Thread(target=work, name=f"tool-{getattr(fn, '__name__', 'fn')}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        return None, f"{getattr(fn, '__name__', 'the tool')} did not return within {timeout_s} s"
    return box.get("value"), box.get("error")


class ToolsEnv:
    """`env=tools` (conf/env/tools.yaml): the same functions in every episode, no first observation."""

    def __init__(self, tools: Any, tool_format: str, max_turns: int, max_tool_calls: int, max_episode_tokens: int,
                 tool_timeout_s: float, max_result_chars: int):
        self.tool_format = tool_format
        self.limits = Limits(max_turns, max_tool_calls, max_episode_tokens, tool_timeout_s, max_result_chars)
        self.tools = load_tools(tools)
        self.schemas = [t.schema for t in self.tools]

    def start(self, row: dict) -> tuple[Toolbox, str | None]:
        return Toolbox({t.name: t for t in self.tools}), None
