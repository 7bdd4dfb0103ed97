"""Which reward scores each training step: one interface, two schedules.

The training step asks its schedule for step n's reward and never which schedule it has:

    reward, tags = schedule.begin(n, policy, tokenizer)   # tags: what step n's record carries before its numbers
    extra = schedule.after(record, history)               # metrics that read the step's own record

`FixedReward` is the paper's outcome or process supervision with one reward for the whole run (§4.1);
`grpo_cli.iterative.IterativeRL` is iterative RL (§4.2), which retrains a reward model at each iteration's
first step. Both say before the model loads what they can check (`check`), and both put what a resume needs
into the trainer state (`state_dict` / `load_state_dict`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from grpo_cli.groups import GroupFilter
from grpo_cli.rewards.call import check_columns, function_names


class RewardSchedule(Protocol):
    truncated_reward: float | None  # the reward a truncated completion gets instead of its score (None: its score)

    def check(self, example: dict, keep: GroupFilter) -> None:
        """Before the model loads: the data has the columns the reward needs, the filter's metric is one it reports."""

    def begin(self, step: int, policy, tokenizer) -> tuple[Any, dict]:
        """(the reward that scores `step`, the fields its record carries first)."""

    def after(self, record: dict, history: list[dict]) -> dict:
        """Metrics computed from step's own record and the earlier steps' (`history`)."""

    def state_dict(self) -> dict:
        """What the trainer state holds for a resume ({} when nothing)."""

    def load_state_dict(self, state: dict, policy, ckpt: Path) -> None:
        """Restore from a checkpoint's trainer state."""


class FixedReward:
    """One built reward scores every step (`reward=...`)."""

    truncated_reward = None

    def __init__(self, reward):
        self.reward = reward

    def check(self, example: dict, keep: GroupFilter) -> None:
        check_columns(self.reward, example)
        keep.check_metric(function_names(self.reward))

    def begin(self, step: int, policy, tokenizer) -> tuple[Any, dict]:
        return self.reward, {}

    def after(self, record: dict, history: list[dict]) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict, policy, ckpt: Path) -> None:
        return None
