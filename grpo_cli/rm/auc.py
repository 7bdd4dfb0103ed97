"""How well a reward model ranks: the pooled ROC AUC, and the within-prompt AUC that GRPO's groups see.

GRPO normalizes rewards within each prompt's group of samples, so only the ranking among one prompt's samples
reaches the policy; a model can rank well pooled (easy prompts score high, hard ones low) and still order each
prompt's own samples at random. `within_prompt_auc` measures that ranking: the AUC among each prompt's samples,
averaged over the prompts whose samples hold both labels.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass


def binary_auc(scores: list[float], positive: list[bool]) -> float | None:
    """ROC AUC = P(score of a random positive > score of a random negative), ties counting 1/2
    (Mann-Whitney U from average ranks); None when one class is absent."""
    n_pos = sum(positive)
    n_neg = len(positive) - n_pos
    if n_pos == 0 or n_neg == 0:
        return None
    order = sorted(range(len(scores)), key=lambda i: scores[i])
    ranks = [0.0] * len(scores)
    i = 0
    while i < len(order):  # tied scores share the average of their 1-based ranks
        j = i
        while j + 1 < len(order) and scores[order[j + 1]] == scores[order[i]]:
            j += 1
        for m in range(i, j + 1):
            ranks[order[m]] = (i + j) / 2 + 1
        i = j + 1
    rank_sum = sum(r for r, p in zip(ranks, positive) if p)
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


@dataclass(frozen=True)
class PromptAUC:
    """The within-prompt AUC and what it rests on."""

    # each ranked prompt's own AUC (its samples hold both labels), by prompt: a paired comparison of two models on
    # the same samples reads these
    per_prompt: dict[Hashable, float]
    total: int  # distinct prompts

    @property
    def prompts(self) -> int:
        """Prompts whose samples hold both labels."""
        return len(self.per_prompt)

    @property
    def auc(self) -> float | None:
        """The mean over the ranked prompts of each one's AUC; None when no prompt has both labels."""
        return sum(self.per_prompt.values()) / len(self.per_prompt) if self.per_prompt else None


def within_prompt_auc(scores: list[float], positive: list[bool], prompts: list[Hashable]) -> PromptAUC:
    """For each prompt (the key of each score) whose samples hold both labels, the AUC among its own samples
    (`binary_auc`: ties count 1/2); their unweighted mean, so each prompt counts once whatever its pair count."""
    groups: dict[Hashable, list[int]] = {}
    for i, key in enumerate(prompts):
        groups.setdefault(key, []).append(i)
    aucs = {key: binary_auc([scores[i] for i in idx], [positive[i] for i in idx]) for key, idx in groups.items()}
    return PromptAUC({key: a for key, a in aucs.items() if a is not None}, len(groups))
