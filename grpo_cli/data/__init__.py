"""Datasets -> examples: the problems GRPO trains on and the held-out problems it is scored on.

Each task is built by Hydra from `conf/data/NAME.yaml` (a `_target_` node) and exposes two
sequences of example dicts (len() and integer indexing):

  - `.train`: the training stream. The trainer draws from it in its own seeded shuffled order.
  - `.heldout`: problems for evaluation. Never in `.train`: the two are disjoint by problem key
    (the operands and operators for arithmetic, the whitespace-normalized question for files).

An example is

    {"messages": [{"role": ..., "content": ...}, ...],  # the prompt, for tokenizer.apply_chat_template
     "question": "What is 34 + 57?",                     # the bare problem
     "answer": "91",                                     # the reference final answer, as a string
     "solution": "34 + 57 = 91\\n#### 91"}                # a worked reference (absent when the data has none)

`messages` is: a system turn (only when `system_prompt` is set), then `few_shot` solved problems
as user/assistant turns (the same ones for every prompt, never in train or held-out), then the user
turn, which is `instruction` with `{question}` replaced by the problem. Reward functions receive
every key except `messages` and `question`.

Tasks:
  - `ArithmeticTask`: procedural, seeded problems such as `34 + 57 * 2`; example i of the train
    stream is a pure function of (seed, i), generated on demand, so a 100k stream costs nothing.
  - `GSM8KTask`: GSM8K from a local JSONL/parquet file or folder, or the hub (`datasets`).
  - `JsonlTask`: any JSONL of problems, with configurable field names and answer extraction.
  - `HFTask`: any dataset the `datasets` library reads (hub, files, save_to_disk), in TRL's prompt formats;
    every column but the prompt stays in the example (grpo_cli/data/hf.py). Its examples also carry
    `prompt` (the prompt as given), and an `answer` only where the dataset has one.
  - `EnvTask`: rows without prompts (generated seeds, or a file's rows) for an environment class that writes each
    prompt in `reset` (`data=env`, grpo_cli/data/env_rows.py); its examples carry `prompt: None` and an empty user
    turn that the environment fills.
  - `MultiStepTask`: ArithmeticTask's problems as chains ("Compute 3 + 9 - 3 - 1."), solved one
    checkable `a op b = c` line per operation, for process supervision.

`build_task(cfg.data)` instantiates a composed `data` node (our errors unwrapped from Hydra's);
`load_task("arithmetic", seed=1)` builds one from its YAML with overrides, for scripts and tests.
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from grpo_cli.data.env_rows import EnvTask
from grpo_cli.data.files import GSM8KTask, JsonlTask
from grpo_cli.data.hf import HFTask
from grpo_cli.data.procedural import ArithmeticTask, MultiStepTask, _Problem, solve
from grpo_cli.data.stream import PromptStream, StreamShard
from grpo_cli.data.task import Example, _Task
from grpo_cli.errors import ConfigError
from grpo_cli.instantiate import build
from grpo_cli.resources import CONF_DIR

__all__ = ["ArithmeticTask", "EnvTask", "Example", "GSM8KTask", "HFTask", "JsonlTask", "MultiStepTask", "PromptStream",
           "StreamShard", "_Problem", "build_task", "load_task", "solve"]


def build_task(node: Any) -> _Task:
    """Instantiate a `data` config node; our ConfigError/DataError come out unwrapped."""
    return build(node)


def load_task(name: str, **overrides: Any) -> _Task:
    """The task conf/data/NAME.yaml builds, with keys replaced by `overrides` (for scripts and tests)."""
    path = CONF_DIR / "data" / f"{name}.yaml"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in path.parent.glob("*.yaml")))
        raise ConfigError(f"no data config named {name!r}; use one of: {known}")
    return build_task(OmegaConf.merge(OmegaConf.load(path), overrides))

