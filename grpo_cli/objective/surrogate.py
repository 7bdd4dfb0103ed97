"""The importance ratio ρ = π_θ / π_old, the per-token term each `loss_type` makes of it (`SURROGATES`), and the
clip statistics.

What follows DeepSeekMath (arXiv 2402.03300) §4.1: the per-token ratio, PPO's term clipped to [1-ε, 1+ε].

Where it departs, and why:
  - an asymmetric clip range `epsilon_high` (DAPO's clip-higher);
  - `importance_sampling_level="sequence"`: GSPO's sequence-level ratio (arXiv 2507.18071), in its
    GSPO-token form so that per-token (process) advantages still work;
  - terms other than PPO's, each a `loss_type` (TRL's names): CISPO's capped, detached IS weight on every token
    (MiniMax-M1, arXiv 2506.13585), SAPO's soft gate (arXiv 2511.20347), GMPO's geometric mean of the token
    ratios clipped in log space (arXiv 2507.20673; TRL has no GMPO, the definition is verl's "geo_mean").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from grpo_cli.objective.aggregation import masked_mean
from grpo_cli.objective.options import choose
from grpo_cli.objective.settings import LossSettings

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


def cispo_surrogate(ratio: torch.Tensor, logp: torch.Tensor, advantages: torch.Tensor, cap: float) -> torch.Tensor:
    """CISPO's term (MiniMax-M1 §3.1; TRL's loss_type="cispo"): sg[min(ρ, cap)]·Â·log π_θ, [N, T] -> [N, T].

    The importance weight is capped and detached instead of the term being clipped: the gradient
    sg[min(ρ, cap)]·Â·∇log π is REINFORCE with a bounded weight, so no token loses its gradient (PPO's clip
    drops the tokens outside its range, often the rare, decisive ones). Its value holds log π, so only its
    gradient compares with PPO's. No lower bound, as in MiniMax-M1 and TRL.
    """
    return ratio.detach().clamp(max=cap) * advantages * logp


def sapo_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, temperature_pos: float,
                   temperature_neg: float) -> torch.Tensor:
    """SAPO's term (arXiv 2511.20347; TRL's loss_type="sapo"): f_τ(ρ)·Â with the soft gate f_τ(ρ) = 4/τ·σ(τ(ρ - 1)),
    τ = temperature_pos where Â > 0, else temperature_neg; [N, T] -> [N, T].

    f_τ'(ρ) = 4σ(1 - σ) is 1 at ρ = 1 (on policy it is the policy gradient, whatever τ) and fades smoothly as ρ
    leaves 1, instead of PPO's step to 0 at the clip edge; a larger τ fades faster (negative advantages
    get the larger one, SAPO's choice: they destabilize more).
    """
    # [N, T], in the ratio's dtype (torch.where of two floats would round them to float32)
    tau = torch.full_like(ratio, temperature_neg).masked_fill(advantages > 0, temperature_pos)
    return torch.sigmoid(tau * (ratio - 1)) * (4 / tau) * advantages


def gmpo_ratio(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, keep: torch.Tensor,
               epsilon_low: float, epsilon_high: float) -> torch.Tensor:
    """GMPO's ratio of each sequence (arXiv 2507.20673 §3; verl's policy loss "geo_mean"): the geometric mean of
    its token ratios, each clipped in log space on the side its advantage makes pessimistic; [N, T] -> [N, 1].

        δ_t = log π_θ - log π_old;   δ̃_t = min(δ_t, ε_high) where Â_t > 0, max(δ_t, -ε_low) where Â_t < 0, 0 at Â_t = 0
        r̃_i = exp(1/|o_i| Σ_t δ̃_t)          over the unmasked tokens; 1 for an empty sequence

    A clipped token gets no gradient; the others get r̃_i·Â/|o_i|. One outlier token moves the geometric mean
    far less than the arithmetic mean of GRPO's per-token terms, hence the wider range (the paper's ±0.4).
    """
    d = torch.where(keep, logp - old_logp.detach(), 0.0)                                  # [N, T]
    clipped = torch.where(advantages > 0, d.clamp(max=epsilon_high), d.clamp(min=-epsilon_low))
    clipped = torch.where(advantages == 0, 0.0, clipped)
    return torch.exp(masked_mean(clipped, keep, dim=1)).unsqueeze(1)


class ClipFractions(NamedTuple):
    """Shares of the counted tokens a bound changed (0-dim each): those whose gradient PPO's clip (or GMPO's) zeroed,
    or whose weight CISPO's cap lowered."""

    low: torch.Tensor     # Â < 0 and ρ < 1-ε_low (GMPO: log ρ < -ε_low)
    high: torch.Tensor    # Â > 0 and ρ > 1+ε_high (GMPO: log ρ > ε_high; CISPO: ρ > cap, any Â)
    region: torch.Tensor  # either


def clip_fractions(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, epsilon_low: float,
                   epsilon_high: float) -> ClipFractions:
    """The clip statistics of `clipped_surrogate`: [N, T] ratio and advantages, [N, T] float mask (nonzero =
    counted; the shares come in its dtype) -> `ClipFractions`. At sequence level a clipped sequence counts with
    all its tokens."""
    low = (advantages < 0) & (ratio < 1 - epsilon_low)             # [N, T]
    high = (advantages > 0) & (ratio > 1 + epsilon_high)
    return _shares(low, high, mask)


def _shares(low: torch.Tensor, high: torch.Tensor, mask: torch.Tensor) -> ClipFractions:
    keep = mask.bool()
    low, high = low & keep, high & keep
    return ClipFractions(masked_mean(low.to(mask.dtype), mask), masked_mean(high.to(mask.dtype), mask),
                         masked_mean((low | high).to(mask.dtype), mask))


# ---- the per-token term of each loss_type ----------------------------------------------------------------


class Surrogate(NamedTuple):
    """One loss_type's per-token term: `term(ratio, logp, old_logp, advantages, keep, settings)` -> (objective [N, T],
    the ratio it weighs [N, T]), `clipped(ratio, advantages, mask, settings)` -> its `ClipFractions`, the settings
    it reads, and whether it makes its own sequence ratio from the token ratios (then only token level makes sense)."""

    term: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    clipped: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, LossSettings], ClipFractions]
    reads: tuple[str, ...] = ()
    own_ratio: bool = False


# Each term: (ratio [N, T] from importance_ratio, logp, old_logp, advantages [N, T], 0 where masked; keep [N, T] bool;
# settings, a LossSettings with epsilon_high filled: `LossSettings.resolved`) -> (objective [N, T], the ratio logged
# as ratio_mean [N, T])


def _ppo(ratio, logp, old, adv, keep, s):
    return clipped_surrogate(ratio, adv, s.epsilon_low, s.epsilon_high), ratio


def _cispo(ratio, logp, old, adv, keep, s):
    return cispo_surrogate(ratio, logp, adv, s.cispo_cap), ratio


def _sapo(ratio, logp, old, adv, keep, s):
    return sapo_surrogate(ratio, adv, s.sapo_temperature_pos, s.sapo_temperature_neg), ratio


def _gmpo(ratio, logp, old, adv, keep, s):
    r = gmpo_ratio(logp, old, adv, keep, s.epsilon_low, s.epsilon_high).expand_as(logp)   # [N, T]
    return r * adv, r   # the aggregation's mean over the sequence makes it r̃_i · mean_t Â (verl's)


# Each: (token ratio [N, T], advantages [N, T], mask [N, T] float, settings) -> the shares of tokens whose term a bound
# changed: PPO's clip (no gradient), CISPO's cap (high: a capped weight), GMPO's log-space clip (no gradient)


def _ppo_clipped(ratio, adv, mask, s):
    return clip_fractions(ratio, adv, mask, s.epsilon_low, s.epsilon_high)


def _cispo_clipped(ratio, adv, mask, s):
    return _shares(torch.zeros_like(ratio, dtype=torch.bool), ratio > s.cispo_cap, mask)


def _unclipped(ratio, adv, mask, s):
    none = torch.zeros_like(ratio, dtype=torch.bool)
    return _shares(none, none, mask)


def _gmpo_clipped(ratio, adv, mask, s):
    d = ratio.log()
    return _shares((adv < 0) & (d < -s.epsilon_low), (adv > 0) & (d > s.epsilon_high), mask)


_CLIP = ("epsilon_low", "epsilon_high")
_PPO = Surrogate(_ppo, _ppo_clipped, _CLIP)
# loss_type -> its per-token term (its aggregation: aggregation.AGGREGATIONS, the same keys)
SURROGATES = {
    "grpo": _PPO, "bnpo": _PPO, "dr_grpo": _PPO, "dapo": _PPO,
    "cispo": Surrogate(_cispo, _cispo_clipped, ("cispo_cap",)),
    "sapo": Surrogate(_sapo, _unclipped, ("sapo_temperature_pos", "sapo_temperature_neg")),
    "gmpo": Surrogate(_gmpo, _gmpo_clipped, _CLIP, own_ratio=True),
}
