"""The sampler's importance weights π_old / π_sampler, for a rollout engine with its own copy of the policy
(vLLM); not the policy's ratio π_θ / π_old, which is `surrogate.importance_ratio`.

Where it departs from the paper (which samples from the trainer's own policy): the weights are truncated or masked,
per token or per sequence (`is_correction_weights`; TRL's four modes, verl's band [low, cap]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from grpo_cli.objective.aggregation import masked_mean
from grpo_cli.objective.options import choose


def truncated_is_weight(old_logp: torch.Tensor, sampling_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance weight of each sampled token: min(π_old / π_sampler, cap) = min(exp(old - sampler), cap).

    [N, T] -> [N, T], detached. The rollout engine (vLLM) samples from its own copy of the policy, whose
    probabilities differ slightly from the trainer's (other kernels, dtype); weighting each token's
    policy-gradient term by this ratio makes the update the trainer's on-policy one again, and the cap
    bounds the variance a rare token with a tiny sampler probability would bring (truncated IS, as
    TRL's vllm_importance_sampling_correction).
    """
    if not cap > 0:
        raise ValueError(f"cap ({cap}) must be > 0")
    return torch.exp(old_logp.detach() - sampling_logp.detach()).clamp(max=cap)


@dataclass(frozen=True)
class ISWeights:
    """What `is_correction_weights` returns: the weights, and what the cap did to them.

    Shares are of the counted tokens (a dropped sequence counts with all its tokens), not of sequences,
    so that they average over micro-batches and ranks like the loss's other token statistics.
    """

    weight: torch.Tensor            # [N, T], detached; 0 on masked positions; per sequence in the sequence modes
    truncated_share: torch.Tensor   # 0-dim: tokens whose weight the cap lowered (truncate modes; else 0)
    masked_share: torch.Tensor      # 0-dim: tokens outside [low, cap], or of sequences outside it (mask modes; else 0)


# Each: (d [N, T] = log π_old - log π_sampler, 0 on masked positions; keep [N, T] bool; m [N, T] float; cap;
# low, the band's lower bound, read by the mask modes only) -> ISWeights


def _token_truncate(d: torch.Tensor, keep: torch.Tensor, m: torch.Tensor, cap: float, low: float) -> ISWeights:
    raw = torch.exp(d)                                   # [N, T]
    weight = torch.where(keep, raw.clamp(max=cap), 0.0)
    return ISWeights(weight, masked_mean((raw > cap).to(m.dtype), m), m.new_zeros(()))


def _sequence_truncate(d: torch.Tensor, keep: torch.Tensor, m: torch.Tensor, cap: float, low: float) -> ISWeights:
    raw = torch.exp(d.sum(1, keepdim=True))              # [N, 1]; inf past ~e^709 (float64): capped all the same
    weight = torch.where(keep, raw.clamp(max=cap), 0.0)
    return ISWeights(weight, masked_mean((raw > cap).expand_as(m).to(m.dtype), m), m.new_zeros(()))


def _mask(log_w: torch.Tensor, keep: torch.Tensor, m: torch.Tensor, cap: float, low: float) -> ISWeights:
    """log_w [N, T] or [N, 1]: the weight is the ratio itself inside [low, cap], 0 outside."""
    inside = (log_w <= math.log(cap)) & (log_w >= math.log(low))   # in log space: no overflow
    weight = torch.where(keep & inside, torch.exp(log_w), 0.0)
    return ISWeights(weight, m.new_zeros(()), masked_mean((~inside).expand_as(m).to(m.dtype), m))


def _token_mask(d: torch.Tensor, keep: torch.Tensor, m: torch.Tensor, cap: float, low: float) -> ISWeights:
    return _mask(d, keep, m, cap, low)                   # each token's own ratio


def _sequence_mask(d: torch.Tensor, keep: torch.Tensor, m: torch.Tensor, cap: float, low: float) -> ISWeights:
    return _mask(d.sum(1, keepdim=True), keep, m, cap, low)   # [N, 1]; log π_old(o_i) / π_sampler(o_i)


IS_CORRECTION_MODES = {"token_truncate": _token_truncate, "token_mask": _token_mask,
                       "sequence_truncate": _sequence_truncate, "sequence_mask": _sequence_mask}
MASK_MODES = ("token_mask", "sequence_mask")
IS_CORRECTIONS = tuple(IS_CORRECTION_MODES)


def is_correction_weights(old_logp: torch.Tensor, sampling_logp: torch.Tensor, mask: torch.Tensor, *,
                          cap: float, mode: str = "token_truncate", low: float | None = None) -> ISWeights:
    """Importance weights π_old / π_sampler for each token's clipped term: [N, T] log-probs -> `ISWeights`.

    π_sampler is the rollout engine's copy of the policy (vLLM), π_old the trainer's; with
    d_i,t = old_i,t - sampler_i,t over the unmasked tokens:
        token_truncate     w_i,t = min(exp(d_i,t), cap)             (`truncated_is_weight`; TRL's default mode)
        token_mask         w_i,t = exp(d_i,t) if it lies in [low, cap], else 0: the token leaves the
                                   policy-gradient term
        sequence_truncate  w_i   = min(exp(Σ_t d_i,t), cap)         on every token of sequence i
        sequence_mask      w_i   = exp(Σ_t d_i,t) if it lies in [low, cap], else 0: the sequence leaves
                                   the policy-gradient term
    A masked token or sequence keeps its KL term and still counts in every aggregation's denominator, as in
    TRL. `low` (None: 1/cap) is read by the mask modes only: truncation lowers the high weights alone.
    The sequence ratio is the ratio of the sequence's probabilities, π_old(o_i) / π_sampler(o_i) = exp(Σ_t d),
    a sum in the exponent, not a mean: TRL (vllm_importance_sampling_mode="sequence_*" sums the per-token
    differences) and verl (rollout_is_level="sequence"; its "geometric" level is the mean) both do so. It
    grows with the length: a gap of 1e-3 per token is a factor e over 1,000 tokens, so a sequence cap is
    set larger than a token cap (verl suggests 2-10 against 1.5-5). The mask band [1/cap, cap] is verl's
    (rollout_is_mode="mask", lower bound 1/upper by default; TRL masks only above cap); inside it the
    weight is the ratio itself, as in both (masked importance sampling), not 1. `low` sets the band's lower
    side apart from the cap (verl's rollout_is_threshold_lower). Masked positions (even NaN) reach nothing;
    an empty sequence has ratio 1.
    """
    correction = choose("is_correction", mode, IS_CORRECTION_MODES)
    if not cap > 0:
        raise ValueError(f"cap ({cap}) must be > 0")
    if low is not None and mode not in MASK_MODES:
        raise ValueError(f"low is read only by the mask modes {MASK_MODES}, not {mode!r}: pass low=None")
    if mode in MASK_MODES:
        if low is None and cap < 1:
            raise ValueError(f"cap ({cap}) must be >= 1 for {mode} without low: the band [1/cap, cap] must hold 1")
        low = 1 / cap if low is None else low
        if not 0 < low <= cap:
            raise ValueError(f"low ({low}) must be in (0, cap] = (0, {cap}]")
    keep = mask.bool()                                   # [N, T]
    m = keep.to(old_logp.dtype)
    d = (old_logp.detach() - sampling_logp.detach()).masked_fill(~keep, 0.0)   # [N, T]; log π_old / π_sampler
    return correction(d, keep, m, cap, low)
