"""The top-entropy mask: which tokens keep the policy-gradient term under `top_entropy_quantile`.

Where it departs from the paper (which trains on every token): with q < 1 only the highest-entropy
tokens carry the policy-gradient term (arXiv 2506.01939, TRL); q = 1 keeps every token.
"""

from __future__ import annotations

import math

import torch


def _check_quantile(quantile: float) -> None:
    if not 0 < quantile <= 1:
        raise ValueError(f"top_entropy_quantile ({quantile}) must be in (0, 1]: the share of highest-entropy "
                         "tokens that carry the policy gradient; 1.0 keeps all")


def high_entropy_threshold(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """The (1 - quantile) quantile of the entropies at the unmasked positions: [N, T] -> 0-dim, detached.

    Linear interpolation between the order statistics (torch.quantile's default, as TRL's
    get_high_entropy_mask). NaN when no position counts, so that `entropy >= threshold` keeps nothing.
    A sort rather than torch.quantile, which refuses more than 2^24 values (a batch of 512 x 32k tokens);
    masked positions sort last as +inf, and the count stays a tensor: no boolean indexing, no host sync.
    """
    _check_quantile(quantile)
    keep = mask.bool().flatten()
    e = entropy.detach().to(torch.promote_types(entropy.dtype, torch.float32)).flatten()   # fp32 at least
    if e.numel() == 0:
        return e.new_full((), math.nan)
    ordered = e.masked_fill(~keep, math.inf).sort().values          # [N·T]; the counted ones first
    last = (keep.sum() - 1).clamp(min=0)                            # 0-dim; index of the largest counted one
    position = (1 - quantile) * last.double()                       # where the quantile falls (float64: exact)
    below = position.floor().long()
    above = torch.minimum(below + 1, last)
    value = torch.lerp(ordered[below], ordered[above], (position - below).to(ordered.dtype))
    return torch.where(keep.any(), value, math.nan)


def entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float, *,
                 threshold: torch.Tensor | float | None = None) -> torch.Tensor:
    """The tokens that keep the policy-gradient term under top_entropy_quantile q: [N, T] -> [N, T] bool.

    "Beyond the 80/20 rule" (arXiv 2506.01939) trains only on the highest-entropy ("forking") tokens:
    a token is kept when it is unmasked and its entropy is at or above `threshold`, by default
    `high_entropy_threshold(entropy, mask, q)`, the (1 - q) quantile over this call's unmasked tokens. Ties
    at the threshold are all kept, so more than a share q may be; q = 1 keeps every unmasked token.
    `threshold`, when given, replaces the quantile of this call: a quantile per call (per micro-batch or length
    bucket, as TRL's) keeps a different set than one over the batch, so micro-batch losses stop adding up to
    the batch loss; `high_entropy_threshold` over the whole batch (all ranks) restores that.
    """
    _check_quantile(quantile)
    keep = mask.bool()
    if threshold is None:
        if quantile == 1:
            return keep
        threshold = high_entropy_threshold(entropy, keep, quantile)
    return keep & (entropy.detach() >= threshold)
