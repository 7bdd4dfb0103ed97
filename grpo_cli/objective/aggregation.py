"""How the per-token objective becomes the loss: `masked_mean`, and the aggregations by `loss_type`, each with
a micro-batch's share of the batch loss (`AGGREGATIONS`).

A loss variant that aggregates differently is one function and its entry in `AGGREGATIONS` (and its
word in conf/algo/grpo.yaml's loss_type comment); every loss_type has its entry here and its per-token term in
`surrogate.SURROGATES`.

What follows DeepSeekMath (arXiv 2402.03300) §4.1: the `grpo` aggregation 1/G Σ_i 1/|o_i| Σ_t.

Where it departs, and why:
  - the aggregations `bnpo`, `dr_grpo` (Dr. GRPO) and `dapo` (DAPO), options from follow-ups; the loss types
    with a term of their own aggregate as TRL does (cispo: dapo's; sapo: grpo's) or as their paper (gmpo: the
    mean over sequences of r̃_i · Â_i, grpo's mean of its per-token form);
  - in the `grpo` aggregation a sequence with no unmasked token (e.g. a truncated completion whose
    loss is masked out) contributes 0 but still counts in the mean over the N sequences, so the
    weight of the other sequences does not depend on how many were masked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over positions where mask != 0 (mask bool or float weights); 0 where none count.

    Masked positions may hold NaN or inf without reaching the result or its gradient.
    """
    m = mask.to(x.dtype)
    xm = torch.where(m != 0, x * m, 0.0)
    if dim is None:
        total, count = xm.sum(), m.sum()
    else:
        total, count = xm.sum(dim), m.sum(dim)
    return total / torch.where(count != 0, count, 1.0)   # an empty row has total 0 -> 0


# Each: (objective [N, T], 0 on masked positions; mask [N, T] float; max_completion_length; normalizer) -> 0-dim


def sequence_mean(objective: torch.Tensor, mask: torch.Tensor, max_completion_length: int | None,
                  normalizer: torch.Tensor | float | None) -> torch.Tensor:
    """grpo (the paper): 1/N Σ_i 1/|o_i| Σ_t; an empty sequence gives 0 and still counts in N."""
    per_seq = objective.sum(1) / mask.sum(1).clamp(min=1)   # [N]; 0 for an empty sequence
    return per_seq.mean()


def token_mean(objective: torch.Tensor, mask: torch.Tensor, max_completion_length: int | None,
               normalizer: torch.Tensor | float | None) -> torch.Tensor:
    """bnpo: Σ_i,t / the unmasked tokens of this batch."""
    return objective.sum() / mask.sum().clamp(min=1)


def constant_length_mean(objective: torch.Tensor, mask: torch.Tensor, max_completion_length: int | None,
                         normalizer: torch.Tensor | float | None) -> torch.Tensor:
    """dr_grpo (Dr. GRPO): Σ_i,t / (N · max_completion_length), a constant; None -> T."""
    n, t = objective.shape
    length = t if max_completion_length is None else max_completion_length
    if length <= 0:
        raise ValueError(f"max_completion_length ({length}) must be > 0")
    return objective.sum() / (n * length)


def accumulated_token_mean(objective: torch.Tensor, mask: torch.Tensor, max_completion_length: int | None,
                           normalizer: torch.Tensor | float | None) -> torch.Tensor:
    """dapo: Σ_i,t / normalizer, the unmasked tokens of the whole accumulated batch (None: this batch's)."""
    if normalizer is None:
        normalizer = mask.sum().clamp(min=1)
    elif not torch.is_tensor(normalizer) and normalizer <= 0:
        raise ValueError(f"normalizer ({normalizer}) must be > 0: the unmasked-token count of the batch")
    return objective.sum() / normalizer


# A micro-batch's share of the batch loss, so that the summed micro-batch gradients equal the batch's:
# (rows, num_sequences, tokens, num_tokens) of the micro-batch and the batch (all ranks, skipped rows included)
def per_sequence(rows: int, num_sequences: int, tokens: torch.Tensor | float,
                 num_tokens: torch.Tensor | float) -> float:
    return rows / num_sequences                          # a micro-batch of 3 of 8 rows: 3/8


def per_token(rows: int, num_sequences: int, tokens: torch.Tensor | float,
              num_tokens: torch.Tensor | float) -> float:
    return float(tokens / num_tokens)


def whole_batch(rows: int, num_sequences: int, tokens: torch.Tensor | float,
                num_tokens: torch.Tensor | float) -> float:
    return 1.0                                           # it divides by the batch's count itself (the normalizer)


class Aggregation(NamedTuple):
    """One loss_type: how the per-token objective becomes the loss, and a micro-batch's share of it."""

    reduce: Callable[[torch.Tensor, torch.Tensor, int | None, torch.Tensor | float | None], torch.Tensor]
    micro_batch_weight: Callable[[int, int, torch.Tensor | float, torch.Tensor | float], float]
    reads_normalizer: bool = False                       # it takes the batch's token count (`normalizer`)


AGGREGATIONS = {
    "grpo": Aggregation(sequence_mean, per_sequence),
    "bnpo": Aggregation(token_mean, per_token),
    "dr_grpo": Aggregation(constant_length_mean, per_sequence),
    "dapo": Aggregation(accumulated_token_mean, whole_batch, reads_normalizer=True),
    "cispo": Aggregation(accumulated_token_mean, whole_batch, reads_normalizer=True),
    "sapo": Aggregation(sequence_mean, per_sequence),
    "gmpo": Aggregation(sequence_mean, per_sequence),
}
LOSS_TYPES = tuple(AGGREGATIONS)
