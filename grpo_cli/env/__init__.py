"""Multi-turn episodes with tools and environments (the `env` config group; docs/environments.md).

`tools.py`: the user's functions, their schemas and a call under a timeout (`env=tools`, in a worker process);
`environments.py`: TRL's `environment_factory` contract (`env=class`); `formats.py`: how tools are shown and calls
read (`env.tool_format`); `parsers.py`: a tool-call parser per model family;
`episode.py`: the episodes themselves, token in and token out, over any engine that continues token ids;
`limits.py`: the limits and their checks. Nothing here knows the trainer, a sampler or the loss: the recipe builds
the `env` node, picks the format (`choose(env.tool_format, tokenizer, env.schemas)`), prepares each row's prompt
and toolbox (`prepare`) and runs the episodes on its engine (`run_episodes(..., env.limits)`).
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from grpo_cli.checks import get, raised
from grpo_cli.env.environments import ClassEnv, dataset_row
from grpo_cli.env.episode import Engine, Episode, EpisodeCounts, environment_rewards, run_episodes
from grpo_cli.env.formats import CHATML_TOOLS_TEMPLATE, ToolFormat, choose
from grpo_cli.env.limits import CHECKS as LIMIT_CHECKS
from grpo_cli.env.limits import Limits
from grpo_cli.env.tools import Tool, Toolbox, ToolsEnv
from grpo_cli.errors import ConfigError
from grpo_cli.instantiate import build

__all__ = ["CHATML_TOOLS_TEMPLATE", "CHECKS", "ClassEnv", "Engine", "Episode", "EpisodeCounts", "Limits", "Tool",
           "ToolFormat", "Toolbox", "ToolsEnv", "choose", "dataset_row", "environment_rewards", "from_config",
           "prepare", "run_episodes"]


def from_config(cfg: DictConfig) -> ToolsEnv | ClassEnv | None:
    """The run's environment, built from its `env` node; None for env=none (and for a run saved before the group
    existed, whose config has no `env`)."""
    present, node = get(cfg, "env")
    env = build(node) if present and isinstance(node, DictConfig) and node.get("_target_") else None
    if env is not None and env.worker is not None:
        # the tools' worker forked now, while the command is small, as a reward's is (grpo_cli.rewards.guard says
        # why): one forked once the model has loaded would cost every training step its copy-on-write pages
        env.worker.start()
    return env


def resolves(cfg: DictConfig) -> None:
    """The `env` node builds: its tools resolve and have schemas, its factory keeps TRL's contract (ConfigError)."""
    present, node = get(cfg, "env")
    if present and isinstance(node, DictConfig) and node.get("_target_"):
        build(node)


def owned_prompts(cfg: DictConfig) -> list[str]:
    """data=env's rows have no prompt: only an environment class (env=class) writes one."""
    data_present, data = get(cfg, "data._target_")
    env_present, env = get(cfg, "env._target_")
    if data_present and data == "grpo_cli.data.EnvTask" and not (env_present and env == "grpo_cli.env.ClassEnv"):
        return ["data=env has no prompts: an environment class writes each one (its reset returns it); set "
                "env=class env.factory=my_env.Game"]
    return []


# the limits' ranges, then the tools or the environment class themselves, and data=env's need of a class: all before
# the model loads
CHECKS = [*LIMIT_CHECKS, raised(resolves), owned_prompts]


def prepare(env: ToolsEnv | ClassEnv, examples: list[dict]) -> tuple[list[list[dict]], list[Toolbox]]:
    """Each example's prompt messages and toolbox, the batch's earlier instances given back first (`begin`):
    `reset(**row)` gets the example's dataset row (`dataset_row`), and a first observation it returns is appended
    to the content of the prompt's last message, as TRL appends it. The messages are the example's `messages`
    (what the chat template renders), else its `prompt` (a string is one user message). A row without a prompt
    (data=env: `prompt` None) gets its prompt from `reset` (`written`)."""
    env.begin()
    prompts, boxes = [], []
    for example in examples:
        given: Any = example["messages"] if "messages" in example else example["prompt"]
        messages = [{"role": "user", "content": given}] if isinstance(given, str) else [dict(m) for m in given]
        box, observation = env.start(dataset_row(example))
        if example.get("prompt", "") is None:
            spec = getattr(env, "spec", None)  # a mapping of classes: name the one this row picked
            messages = messages[:-1] + written(observation, spec if isinstance(spec, str)
                                               else type(box.environment).__name__)
        elif observation is not None:
            messages[-1]["content"] = messages[-1]["content"] + str(observation)
        prompts.append(messages)
        boxes.append(box)
    return prompts, boxes


def written(observation: Any, spec: Any) -> list[dict]:
    """The turns an environment wrote in place of a row's missing prompt: a string is the user turn, a list of
    {role, content} messages is used as it is (earlier turns, a demonstration, then the user's); ConfigError for
    anything else, or messages that do not end with the user's turn."""
    where = f"env.factory ({spec}): reset(**row) returned"
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    is_messages = (isinstance(observation, list) and observation
                   and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                           and isinstance(m.get("content"), str) for m in observation))
    if not is_messages:
        raise ConfigError(f"{where} {type(observation).__name__ if observation is not None else 'None'} on a row "
                          f"without a prompt (data=env); return the prompt: a string (the user turn) or a list of "
                          f"{{role, content}} messages")
    if observation[-1]["role"] != "user":
        raise ConfigError(f"{where} messages whose last has role {observation[-1]['role']!r}; the last must be "
                          f"the user's turn the model answers")
    return [dict(m) for m in observation]
