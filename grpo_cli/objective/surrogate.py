"""The importance ratio ρ = π_θ / π_old and PPO's clipped term on it, with the clip statistics.

What follows DeepSeekMath (arXiv 2402.03300) §4.1: the per-token ratio, clipped to [1-ε, 1+ε].

Where it departs, and why:
  - an asymmetric clip range `epsilon_high` (DAPO's clip-higher);
  - `importance_sampling_level="sequence"`: GSPO's sequence-level ratio (arXiv 2507.18071), in its
    GSPO-token form so that per-token (process) advantages still work.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from grpo_cli.objective.aggregation import masked_mean
from grpo_cli.objective.options import choose

# GSPO's clip range (arXiv 2507.18071 v2, §5.1; TRL's paper index uses the same): the sequence ratio is a
# geometric mean of token ratios, so it strays from 1 far less than a token ratio and needs a range ~1000x
# narrower than PPO's 0.2
GSPO_EPSILON_LOW = 3e-4
GSPO_EPSILON_HIGH = 4e-4


def _token_ratio(lp: torch.Tensor, old: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return torch.exp(lp - old)                           # [N, T]; 1 on masked positions


def _sequence_ratio(lp: torch.Tensor, old: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    log_s = masked_mean((lp - old).detach(), keep, dim=1)   # [N]; log s_i, 0 for an empty sequence
    # (lp - sg[lp]) first: it is exactly 0, so the value is exactly s_i (log s + lp - lp would round
    # log s ~ 1e-4 against |lp| ~ 10 and miss GSPO's 3e-4 clip range by a percent)
    return torch.exp(log_s.unsqueeze(1) + (lp - lp.detach()))


IMPORTANCE_RATIOS = {"token": _token_ratio, "sequence": _sequence_ratio}
IMPORTANCE_SAMPLING_LEVELS = tuple(IMPORTANCE_RATIOS)


def importance_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor,
                     level: str = "token") -> torch.Tensor:
    """π_θ / π_old of each sampled token, at token or sequence level: [N, T] -> [N, T].

    token (GRPO, PPO):  ρ_i,t = exp(logp_i,t - old_i,t)
    sequence (GSPO, arXiv 2507.18071 §4, in its GSPO-token form):
        s_i = exp(1/|o_i| Σ_t (logp_i,t - old_i,t))      over the unmasked tokens of sequence i
        ρ_i,t = sg[s_i] · π_θ(o_i,t) / sg[π_θ(o_i,t)]       = exp(sg[log s_i] + (logp_i,t - sg[logp_i,t]))
    so every token of sequence i has the value s_i (a clip on it keeps or drops the whole sequence) and
    ∂ρ_i,t/∂logp_i,t = s_i. With the same advantage on every token of a sequence (outcome supervision)
    the gradient equals that of GSPO's sequence objective; with per-token advantages each token keeps its
    own (GSPO's reason for the token form). old_logp is detached; masked positions (even ±inf) count in
    nothing, and an empty sequence has s = 1.
    """
    ratio = choose("importance_sampling_level", level, IMPORTANCE_RATIOS)
    keep = mask.bool()
    lp = logp.masked_fill(~keep, 0.0)
    old = old_logp.detach().masked_fill(~keep, 0.0)
    return ratio(lp, old, keep)


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, epsilon_low: float,
                      epsilon_high: float) -> torch.Tensor:
    """PPO's clipped term: min(ρ·Â, clip(ρ, 1-ε_low, 1+ε_high)·Â), [N, T] ratio and advantages -> [N, T].

    Where the clip binds (Â > 0 and ρ > 1+ε_high, or Â < 0 and ρ < 1-ε_low) the value is constant in ρ,
    so the token gets no gradient.
    """
    clipped = ratio.clamp(1 - epsilon_low, 1 + epsilon_high)
    return torch.minimum(ratio * advantages, clipped * advantages)


class ClipFractions(NamedTuple):
    """Shares of the counted tokens the clip cut (0-dim each): the tokens whose gradient it zeroed."""

    low: torch.Tensor     # Â < 0 and ρ < 1-ε_low
    high: torch.Tensor    # Â > 0 and ρ > 1+ε_high
    region: torch.Tensor  # either


def clip_fractions(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, epsilon_low: float,
                   epsilon_high: float) -> ClipFractions:
    """The clip statistics of `clipped_surrogate`: [N, T] ratio and advantages, [N, T] float mask (nonzero =
    counted; the shares come in its dtype) -> `ClipFractions`. At sequence level a clipped sequence counts with
    all its tokens."""
    keep = mask.bool()
    low = (advantages < 0) & (ratio < 1 - epsilon_low) & keep      # [N, T]
    high = (advantages > 0) & (ratio > 1 + epsilon_high) & keep
    return ClipFractions(masked_mean(low.to(mask.dtype), mask), masked_mean(high.to(mask.dtype), mask),
                         masked_mean((low | high).to(mask.dtype), mask))
