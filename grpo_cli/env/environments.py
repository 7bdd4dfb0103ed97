"""Environments: TRL's `environment_factory` contract, as TRL's GRPOTrainer has it now, so a TRL environment class
runs here unchanged (docs/environments.md has the table, each row with the TRL source it was read from).

    grpo train env=class env.factory=my_env.Game
    grpo train env=class 'env.factory={wordle: my_env.Wordle, catch: my_env.Catch}'   # chosen per row
    grpo train env=class env.factory=my_env.Game 'env.tools=[my_tools.search]'        # plain tools beside it

- `env.factory` names a class (or any callable) that takes no argument, or a mapping of names to such; with a
  mapping each row picks its environment by its `env.factory_column` column (TRL: `environment`), and the episode
  shows and can call only that environment's tools;
- instances are pooled: an episode takes an idle instance of its kind (one is built when none is idle), calls
  `reset(**row)` on it, and gives it back once the step's rewards have read it (at the next batch); `close()`,
  when the class defines it, is called once on every instance at the end (`ClassEnv.close`, or at exit). `reset`
  must therefore clear what the previous episode left;
- `reset(**row)` receives the dataset row as the data gives it: every column as a keyword, the prompt as given
  (`prompt`), not grpo's own chat `messages` or `question`; for a built-in task, which has no prompt column,
  `prompt` is the problem's text (what reward functions get as `prompts`). A value it returns that is not None is
  appended, as text, to the content of the prompt's last message;
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

import inspect
from collections.abc import Callable
from typing import Any

from grpo_cli.env.limits import Limits
from grpo_cli.env.tools import Tool, Toolbox, tool_from
from grpo_cli.errors import ConfigError
from grpo_cli.rewards.user import BUILTINS
from grpo_cli.user_code import load_function


def load_factory(spec: Any) -> tuple[Callable[[], Any], list[Tool]]:
    """(the callable `env.factory` names, its tools), checked against the contract on one instance."""
    if not isinstance(spec, str) or not spec.strip() or spec.strip() in BUILTINS:
        raise ConfigError(f"env.factory ({spec!r}) must name an environment class: env.factory=my_env.Game or "
                          f"env.factory=path/to/my_env.py:Game")
    try:
        _, factory = load_function(spec, "env.factory", BUILTINS)
    except ConfigError as err:  # the shared resolver names reward.funcs in its fixes
        raise ConfigError(str(err).replace("reward.funcs", "env.factory")) from None
    return factory, methods(build(factory, spec), spec)


def build(factory: Callable[[], Any], spec: str) -> Any:
    try:
        return factory()
    except Exception as err:
        raise ConfigError(f"env.factory ({spec}): calling it raised {type(err).__name__}: {err}; the factory is "
                          f"called with no argument, once per episode") from None


def methods(instance: Any, spec: str) -> list[Tool]:
    """The instance's public methods as tools; ConfigError when `reset` is missing or a method lacks a schema."""
    members = bound_methods(instance)
    if "reset" not in members:
        raise ConfigError(f"env.factory ({spec}): {type(instance).__name__} has no reset method; give it "
                          f"def reset(self, **row) (it receives the dataset row, and may return the first "
                          f"observation)")
    names = [n for n in members if n != "reset" and not n.startswith("_")]
    if not names:
        raise ConfigError(f"env.factory ({spec}): {type(instance).__name__} has no public method besides reset; "
                          f"its public methods are the model's tools, so give it at least one")
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


def start(factory: Callable[[], Any], spec: str, row: dict) -> tuple[Toolbox, str | None]:
    """A fresh instance for one episode: (its toolbox, the first observation `reset(**row)` returned, or None)."""
    instance = build(factory, spec)
    tools = methods(instance, spec)
    try:
        observation = instance.reset(**row)
    except Exception as err:
        raise ConfigError(f"env.factory ({spec}): reset(**row) raised {type(err).__name__}: {err} on a row with "
                          f"columns {', '.join(row)}; reset receives every column as a keyword: "
                          f"def reset(self, **row)") from None
    return Toolbox({t.name: t for t in tools}, environment=instance), (None if observation is None
                                                                        else str(observation))


class ClassEnv:
    """`env=class` (conf/env/class.yaml): a fresh instance of `factory` per episode, its methods the tools."""

    def __init__(self, factory: str, tool_format: str, max_turns: int, max_tool_calls: int, max_episode_tokens: int,
                 tool_timeout_s: float, max_result_chars: int):
        self.tool_format, self.spec = tool_format, factory
        self.limits = Limits(max_turns, max_tool_calls, max_episode_tokens, tool_timeout_s, max_result_chars)
        self.factory, tools = load_factory(factory)
        # every instance has the same methods: the prompt shows the checked instance's schemas
        self.schemas = [t.schema for t in tools]

    def start(self, row: dict) -> tuple[Toolbox, str | None]:
        return start(self.factory, self.spec, row)
