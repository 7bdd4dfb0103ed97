"""Reward functions from the user's own code, called as TRL's GRPOTrainer calls them (`reward=custom`).

    grpo train data=hf data.path=prompts.jsonl reward=custom 'reward.funcs=[my_rewards.unit_reward,accuracy]'
    grpo train ... reward=custom 'reward.funcs=[path/to/rewards.py:unit_reward]' 'reward.weights=[1.0,0.5]'

Each entry of `reward.funcs` is `module.fn` (a module of the working folder, or an installed one:
grpo_cli.user_code resolves it and refuses a file of the folder named like an installed module),
`path/to/file.py:fn`, or a built-in's short name (`accuracy`, `format`: grpo_cli.rewards.outcome).
A user's function runs unchanged from a GRPOTrainer script:

    fn(prompts=..., completions=..., completion_ids=..., **columns) -> list[float | None]

`prompts` are the prompts as the dataset gives them; `completions` are strings for string prompts
and, for prompts given as messages, what TRL passes: `[{"role": "assistant", "content": text}]`
each. `completion_ids` are each completion's token ids (EOS included); `columns` are the example's
other fields (every dataset column but the prompt, for `data=hf`) plus `completion_length` and
`truncated`. TRL's `trainer_state` and `log_extra` are not passed. A function may be `async def`. For a
multi-turn episode (`env=tools`, `env=class`) it may return a list instead of a number, one score per assistant
turn (per-turn rewards: docs/environments.md).
Functions of grpo_cli itself (the built-ins) get plain strings, as everywhere in grpo_cli.

Everything that can be wrong from the config alone stops the run before the model loads (the
commands build the reward first): a name that does not import (with the sys.path searched), a
signature that cannot take `(prompts, completions, **kwargs)`, weights of the wrong length. A
function that raises during a step costs its completions their score, as for every reward
(grpo_cli.rewards.guard).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

from grpo_cli.checks import is_num
from grpo_cli.errors import ConfigError
from grpo_cli.rewards.combine import OutcomeReward
from grpo_cli.rewards.outcome import accuracy, format_reward
from grpo_cli.user_code import load_function

# short names for grpo_cli's own outcome functions, with their YAML defaults (format: GSM8K's "#### N" line)
BUILTINS: dict[str, Callable] = {"accuracy": accuracy, "format": format_reward}

def _check_signature(fn: Callable, spec: str, where: str) -> None:
    """`fn` must take fn(prompts=..., completions=..., **columns): `**kwargs`, and no other required positional-only
    parameter (a named one is a column, checked against the data by grpo_cli.rewards.call.check_columns)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C function without a signature: leave it to the call
        return
    shown = f"({', '.join(str(p) for p in params)})"
    blocked = [p.name for p in params if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    if blocked or not any(p.kind is p.VAR_KEYWORD for p in params):
        raise ConfigError(f"{where}: {spec} takes {shown}, but a reward function is called as fn(prompts=..., "
                          f"completions=..., completion_ids=..., **columns), as TRL's GRPOTrainer calls it; give it "
                          f"keyword parameters and **kwargs: def {getattr(fn, '__name__', 'fn')}(prompts, "
                          f"completions, **kwargs)")


class TRLFunction:
    """A user's reward function, called as TRL's GRPOTrainer calls it (see the module docstring)."""

    def __init__(self, fn: Callable, spec: str):
        self.user_function, self.spec = fn, spec

    def __call__(self, prompts: list, completions: list[str], **columns: Any) -> Any:
        given = columns.pop("prompt", None)  # the prompts as the dataset gives them (data=hf)
        if given is not None:
            prompts = given
        messages = columns.pop("completion_messages", None)  # multi-turn episodes: the assistant and tool turns
        if messages is not None:
            completions = messages
        elif prompts and isinstance(prompts[0], list):  # conversational: what TRL hands a reward function
            completions = [[{"role": "assistant", "content": text}] for text in completions]
        out = self.user_function(prompts=prompts, completions=completions, **columns)
        return asyncio.run(out) if inspect.iscoroutine(out) else out

    def __repr__(self) -> str:
        return f"TRLFunction({self.spec})"


class CustomReward(OutcomeReward):
    """`reward=custom`: a weighted sum of the functions named in `funcs` (user code or built-ins).

    Each function's raw score is logged as `rewards/<its __name__>/mean` (a built-in: its short name; a
    second function of the same name gets `_2`).
    """

    def __init__(self, funcs: Any, weights: Any, timeout_s: float | None, worker: str):
        specs = [funcs] if isinstance(funcs, str) else list(funcs or [])
        if not specs:
            raise ConfigError("reward.funcs is empty; name at least one function: reward.funcs=[my_rewards.fn]")
        if weights is None:
            weights = [1.0] * len(specs)
        if isinstance(weights, (int, float)) and not isinstance(weights, bool):
            weights = [weights]
        if not isinstance(weights, (list, tuple)) or len(weights) != len(specs) or not all(is_num(w) for w in weights):
            ones = ",".join(["1.0"] * len(specs))
            raise ConfigError(f"reward.weights ({weights!r}) must be a list of numbers, one per function of "
                              f"reward.funcs ({len(specs)}: {', '.join(map(str, specs))}); set "
                              f"reward.weights=[{ones}] or reward.weights=null (1.0 each)")
        functions: dict[str, Callable] = {}
        named: dict[str, float] = {}
        for i, (spec, weight) in enumerate(zip(specs, weights)):
            where = f"reward.funcs[{i}]"
            name, fn = load_function(spec, where, BUILTINS)
            if not str(getattr(fn, "__module__", "")).startswith("grpo_cli."):
                _check_signature(fn, str(spec), where)
                fn = TRLFunction(fn, str(spec))
            unique, k = name, 2
            while unique in functions:
                unique, k = f"{name}_{k}", k + 1
            functions[unique], named[unique] = fn, float(weight)
        super().__init__(functions, weights=named, timeout_s=timeout_s, worker=worker)
