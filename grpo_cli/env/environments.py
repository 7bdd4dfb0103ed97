"""Environments: TRL's `environment_factory` contract, as TRL's GRPOTrainer has it now, so a TRL environment class
runs here unchanged (docs/environments.md has the table, each row with the TRL source it was read from).

    grpo train env=class env.factory=my_env.Game
    grpo train env=class 'env.factory={wordle: my_env.Wordle, catch: my_env.Catch}'   # chosen per row
    grpo train env=class env.factory=my_env.Game 'env.tools=[my_tools.search]'        # plain tools beside it

- `env.factory` names a class (or any callable) that takes no argument, or a mapping of names to such; with a
  mapping each row picks its environment by its `env.factory_column` column (TRL: `environment`), and the episode
  shows and can call only that environment's tools;
- instances are pooled: an episode takes an idle instance of its kind (one is built when none is idle), calls
  `reset(**row)` on it, and gives it back once the rewards have read it (two batches later); `close()`,
  when the class defines it, is called once on every instance at the end (`ClassEnv.close`, or at exit). `reset`
  must therefore clear what the previous episode left;
- `reset(**row)` receives the dataset row as the data gives it: every column as a keyword, the prompt as given
  (`prompt`), not grpo's own chat `messages` or `question`; for a built-in task, which has no prompt column,
  `prompt` is the problem's text (what reward functions get as `prompts`). A value it returns that is not None is
  appended, as text, to the content of the prompt's last message; a row without a prompt (data=env) gets none, and
  what `reset` returns is its prompt (grpo_cli.env.prepare);
- its public methods (bound methods whose name does not start with `_`), except the reserved `reset`,
  `get_reward` and `close`, are the episode's tools, each with the type hints and docstring a plain tool needs
  (grpo_cli.env.tools); `async def` methods run on the run's one event loop;
- `get_reward()` (no argument, a number; sync or async), when defined, is called once per finished episode,
  before the instance goes back to the pool, and is one more reward source: weight 1, named after the class, added
  to what the run's reward functions give (grpo_cli.rewards.call.score). It is never a tool;
- reward functions can still read the instances: `environments=[...]`, one per completion, as TRL passes them;
- plain tools (`env.tools`) may join the environment's methods in every episode; they run in the tools' worker
  process, as `env=tools` runs them, and the methods in threads of this process (grpo_cli.env.tools says why).

What is checked before the model loads: the names resolve, each factory builds an instance (kept: the pool's
first), the instance has `reset`, and every public method has a schema. The methods are found on the class
without reading any other attribute, so a property that needs `reset()` first is never evaluated. A `reset` that
raises on some row stops the run with one line naming the environment, the row's columns and the error.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from grpo_cli import workers
from grpo_cli.env.limits import Limits
from grpo_cli.env.tools import Tool, Toolbox, ToolWorker, event_loop, load_tools, tool_from
from grpo_cli.errors import ConfigError
from grpo_cli.rewards.user import BUILTINS
from grpo_cli.user_code import load_function

log = logging.getLogger(__name__)

# methods the contract reserves: never the model's tools
RESERVED = ("reset", "get_reward", "close")
# the example's keys that are grpo's own, not the dataset's: the chat messages and the question's text
OWN_KEYS = ("messages", "question")


def load_factory(spec: Any, where: str = "env.factory") -> tuple[Callable[[], Any], Any, list[Tool]]:
    """(the callable `spec` names, the instance the contract was checked on, its tools)."""
    if not isinstance(spec, str) or not spec.strip() or spec.strip() in BUILTINS:
        raise ConfigError(f"{where} ({spec!r}) must name an environment class: env.factory=my_env.Game or "
                          f"env.factory=path/to/my_env.py:Game")
    try:
        _, factory = load_function(spec, where, BUILTINS)
    except ConfigError as err:  # the shared resolver names reward.funcs in its fixes
        raise ConfigError(str(err).replace("reward.funcs", "env.factory")) from None
    instance = build(factory, spec)
    return factory, instance, methods(instance, spec)


def build(factory: Callable[[], Any], spec: str) -> Any:
    try:
        return factory()
    except Exception as err:
        raise ConfigError(f"env.factory ({spec}): calling it raised {type(err).__name__}: {err}; the factory is "
                          f"called with no argument, once per instance of the pool") from None


def methods(instance: Any, spec: str) -> list[Tool]:
    """The instance's public methods but the reserved ones, as tools; ConfigError when `reset` is missing or a
    method lacks a schema."""
    members = bound_methods(instance)
    if "reset" not in members:
        raise ConfigError(f"env.factory ({spec}): {type(instance).__name__} has no reset method; give it "
                          f"def reset(self, **row) (it receives the dataset row, and may return the first "
                          f"observation)")
    names = [n for n in members if n not in RESERVED and not n.startswith("_")]
    if not names:
        raise ConfigError(f"env.factory ({spec}): {type(instance).__name__} has no public method besides "
                          f"{', '.join(RESERVED)}; its public methods are the model's tools, so give it at least one")
    return [tool_from(members[n], f"env.factory ({spec}): method {n}") for n in names]


def bound_methods(instance: Any) -> dict[str, Callable]:
    """The instance's bound methods by name, sorted (what `inspect.getmembers(instance, inspect.ismethod)` finds),
    found without reading any other attribute: getmembers evaluates every property, and an environment's
    property may need reset() first."""
    own = getattr(instance, "__dict__", {})
    found = {}
    for name in sorted(set(dir(type(instance))) | set(own)):
        static = inspect.getattr_static(instance, name, None)
        if name in own and static is own[name]:  # set on the instance: a method only when already bound
            bound = inspect.ismethod(static)
        else:  # the class's: a function or a classmethod binds to a method (a staticmethod stays a function)
            bound = inspect.isfunction(static) or isinstance(static, classmethod)
        if bound:
            found[name] = getattr(instance, name)  # binding runs none of the user's code
    return found


def dataset_row(example: dict) -> dict:
    """The row `reset(**row)` receives: the example's dataset columns as the data gives them, the prompt as given;
    a built-in task's example, which has no prompt column, gives its problem's text as `prompt`, and a row whose
    prompt the environment writes (data=env: `prompt` None) gives no `prompt` at all, as TRL keeps its placeholder
    prompt out of reset's keywords."""
    row = {k: v for k, v in example.items() if k not in OWN_KEYS}
    if "prompt" not in row and "question" in example:
        row["prompt"] = example["question"]
    if row.get("prompt", "") is None:
        del row["prompt"]
    return row


@dataclass
class Kind:
    """One environment class of the run (`env.factory`, or one value of its mapping) and its pool."""

    spec: str
    factory: Callable[[], Any]
    tools: list[Tool]
    # the class defines get_reward: its score is a reward source
    scored: bool
    # instances not in an episode now, ready for reset
    idle: list = field(default_factory=list)

    def bind(self, instance: Any) -> dict[str, Tool]:
        """This instance's methods as its episode's tools (the schemas checked once, on the first instance)."""
        return {t.name: Tool(t.name, getattr(instance, t.name), t.schema) for t in self.tools}


def score_environment(instance: Any) -> tuple[float | None, str | None]:
    """(its `get_reward()` as a float, None) or (None, why it gave none): a method that raises or returns no
    number costs that episode's score from the environment, not the run. An async one runs on the run's loop."""
    try:
        value = instance.get_reward()
        if inspect.iscoroutine(value):
            value = asyncio.run_coroutine_threadsafe(value, event_loop()).result()
        return float(value), None
    except Exception as err:
        return None, f"{type(instance).__name__}.get_reward() raised {type(err).__name__}: {err}"


def _close_all(instances: list) -> None:
    """close() once on every instance that defines it; one that raises is logged, the others still close."""
    while instances:
        instance = instances.pop()
        closer = bound_methods(instance).get("close")
        if closer is None:
            continue
        try:
            closer()
        except Exception as err:
            log.warning("%s.close() raised %s: %s", type(instance).__name__, type(err).__name__, err)


class ClassEnv:
    """`env=class` (conf/env/class.yaml): pooled instances of `factory` (or of the one each row picks), their
    methods the tools, `tools` beside them."""

    def __init__(self, factory: Any, tool_format: str, max_turns: int, max_tool_calls: int, max_episode_tokens: int,
                 tool_timeout_s: float, max_result_chars: int, tools: Any = None,
                 factory_column: str = "environment"):
        self.tool_format, self.spec, self.column = tool_format, factory, factory_column
        self.limits = Limits(max_turns, max_tool_calls, max_episode_tokens, tool_timeout_s, max_result_chars)
        specs = dict(factory) if isinstance(factory, Mapping) else {None: factory}
        if not specs:
            raise ConfigError("env.factory is an empty mapping; name at least one environment class: "
                              "'env.factory={game: my_env.Game}'")
        self._all: list = []  # every instance built, closed at the end
        self.kinds: dict[str | None, Kind] = {}
        for name, spec in specs.items():
            made, instance, own = load_factory(spec, "env.factory" if name is None else f"env.factory.{name}")
            self.kinds[name] = Kind(spec, made, own, "get_reward" in bound_methods(instance), [instance])
            self._all.append(instance)
        self.plain = load_tools(tools) if tools else []
        for kind in self.kinds.values():
            clash = sorted({t.name for t in kind.tools} & {t.name for t in self.plain})
            if clash:
                raise ConfigError(f"env.tools: {clash[0]!r} is also a method of {kind.spec}; the model calls tools "
                                  f"by name, so rename the function or the method")
        # plain tools run in a worker process, as env=tools runs them (None where the platform cannot fork)
        self.worker = ToolWorker(self.plain) if self.plain and workers.available() else None
        # what the prompt may show: every kind's methods and the plain tools (one schema per name), for the format
        schemas = {t.name: t.schema for kind in self.kinds.values() for t in kind.tools}
        self.schemas = [t.schema for t in self.plain] + list(schemas.values())
        # the instances out in the last batches of episodes, oldest first, each [(its kind, the instance)]
        self._busy: list[list[tuple[Kind, Any]]] = [[]]
        # at exit, if close() was not called first: every instance still closes once
        self._closing = weakref.finalize(self, _close_all, self._all)

    def begin(self) -> None:
        """A new batch of episodes: the instances of the batch before the previous one go back to their pools. Two
        batches stay out: a step scores its batch before it samples the next, but `grpo eval` samples greedy and
        sampled episodes of the same problems before it scores both, and its rewards read both batches' instances."""
        if len(self._busy) == 2:
            for kind, instance in self._busy.pop(0):
                kind.idle.append(instance)
        self._busy.append([])

    def _kind(self, row: dict) -> Kind:
        if None in self.kinds:
            return self.kinds[None]
        if self.column not in row:
            raise ConfigError(f"env.factory names {len(self.kinds)} environments, and a row has no column "
                              f"{self.column!r} to pick one (its columns: {', '.join(row)}); add that column with one "
                              f"of {', '.join(map(repr, self.kinds))}, or set env.factory_column")
        name = row[self.column]
        if name not in self.kinds:
            raise ConfigError(f"a row's env.factory_column {self.column!r} is {name!r}, which env.factory does not "
                              f"name (it names {', '.join(map(repr, self.kinds))}); fix the row or add it to "
                              f"env.factory")
        return self.kinds[name]

    def start(self, row: dict) -> tuple[Toolbox, Any]:
        """An instance for one episode, from its kind's pool (built when none is idle) and reset on `row`:
        (its toolbox, what `reset(**row)` returned: the first observation, or None)."""
        kind = self._kind(row)
        if kind.idle:
            instance = kind.idle.pop()
        else:
            instance = build(kind.factory, kind.spec)
            self._all.append(instance)
        self._busy[-1].append((kind, instance))
        try:
            observation = instance.reset(**row)
        except Exception as err:
            raise ConfigError(f"env.factory ({kind.spec}): reset(**row) raised {type(err).__name__}: {err} on a row "
                              f"with columns {', '.join(row)}; reset receives every column as a keyword: "
                              f"def reset(self, **row)") from None
        tools = {t.name: t for t in self.plain} | kind.bind(instance)
        box = Toolbox(tools, environment=instance, worker=self.worker,
                      reward=(lambda: score_environment(instance)) if kind.scored else None)
        return box, observation

    def close(self) -> None:
        """The end of the run: close() once on every instance that defines it, and the tools' worker stopped."""
        self._closing()
        if self.worker is not None:
            self.worker.stop()
