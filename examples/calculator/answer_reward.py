"""The example's reward: 1.0 when the episode's final answer is the product, else 0.0 (`reward=custom
'reward.funcs=[answer_reward.correct]'`), written as for TRL's GRPOTrainer.

`completions` are, per episode, the assistant and tool messages (with tools) or one assistant message (without);
the final answer is the last integer of the last assistant message, commas and spaces inside a number allowed.
"""

from __future__ import annotations

import re

_INTEGER = re.compile(r"-?\d[\d,]*")


def final_answer(completion) -> int | None:
    """The last integer of the completion's last assistant turn (None when it has none)."""
    if isinstance(completion, list):
        turns = [m.get("content") or "" for m in completion if m.get("role") == "assistant"]
        completion = turns[-1] if turns else ""
    found = _INTEGER.findall(completion)
    return int(found[-1].replace(",", "")) if found else None


def correct(completions, answer, **kwargs) -> list[float]:
    return [float(final_answer(c) == int(a)) for c, a in zip(completions, answer)]
