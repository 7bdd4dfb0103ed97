"""The record one reward call gives the trainer: `RewardResult`.

Outcome rewards fill `rewards` (one scalar per completion, DeepSeekMath §4.1.2); process rewards also
fill `steps` (a reward per reasoning step, §4.1.3), and `rewards` is then each completion's sum of its
step rewards. A reward function that scores a multi-turn episode's turns fills `turns` (a reward per assistant
turn, the same process supervision with the turns as its steps); `rewards` is then each episode's sum.
Shaping (`grpo_cli.rewards.shaping`) returns a new record of the same type.
"""

from __future__ import annotations

from dataclasses import dataclass

from grpo_cli.records import Rows, first, keyed, row, whole


@dataclass
class RewardResult(Rows):
    """What one reward call gives the trainer; its rows are picked and joined by the fields' declarations
    (grpo_cli.records: take, cat).

    rewards: per completion; None = no score (every function gave None or failed).
    per_function: raw (unweighted) scores per function name, for `rewards/<name>/mean` metrics; a
        process reward adds `steps`, each completion's mean step reward.
    failures: function calls (one per function per batch) that raised, timed out or returned a
        malformed result. A call that raised is retried one completion at a time, so only the
        completions it fails on lose their score.
    steps: process rewards only: per completion, [(char_end, reward), ...] in text order, char_end
        exclusive (several steps may share one); [] when the completion has no scored step. None for
        outcome rewards.
    outcome: process rewards combined with outcome ones: per completion, the outcome functions' sum.
    process_weight: λ of A = A_outcome + λ·A_process (`credit.advantages`); None: process only.
    turns: per-turn rewards only: per episode, one reward (None: unscored) per assistant turn, in turn order; each
        sits on its turn's last sampled token. None when no function scored turns.
    credit: process rewards only: how a token's advantage gathers the steps after it, "sum" (the paper's) or
        "min" (PURE's; `objective.process_advantages`).
    """

    rewards: list[float | None] = row()
    per_function: dict[str, list[float | None]] = keyed()
    failures: int = whole(sum, default=0)  # a batch's: kept by take, summed by cat
    steps: list[list[tuple[int, float]]] | None = row(default=None)
    outcome: list[float | None] | None = row(default=None)
    process_weight: float | None = whole(first, default=None)
    # a part scored per episode joins a per-turn one with each reward as its last turn's (credit.token_rewards aligns
    # a short row with the episode's last turns)
    turns: list[list[float | None]] | None = row(absent=lambda part: [[] if r is None else [r] for r in part.rewards],
                                                 default=None)
    credit: str = whole(first, default="sum")
