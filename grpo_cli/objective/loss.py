"""The loss: `grpo_loss`, composed from the other modules' pieces, `GRPOLoss`, its `LossSettings` bound once
(the class the `algo.loss` config node names), and `Loss`, what the update asks of any loss. `grpo_loss` reads as
the formula:

    ρ = importance_ratio(logp, old)                       # π_θ / π_old, per token or per sequence (GSPO)
    objective = SURROGATES[loss_type](ρ, Â, ...)          # PPO's min(ρ·Â, clip(ρ, 1-ε_low, 1+ε_high)·Â), or
                                                          # CISPO's, SAPO's, GMPO's term
              · is_weight · [H ≥ h_q]                     # sampler IS weight; top-entropy mask
              - β·KL(π_θ || π_ref) + entropy_coef·H       # kl_divergence; entropy bonus
    loss = -AGGREGATIONS[loss_type].reduce(objective)      # over tokens and sequences
    stats: KL, ratio, clip_fractions(ρ, Â, ...)

What follows DeepSeekMath (arXiv 2402.03300) §4.1: the KL is added to the per-token objective (not to the
reward), weighted by β. Where it departs: an entropy bonus `entropy_coef` (verl's entropy_coeff).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from grpo_cli.objective.aggregation import AGGREGATIONS, masked_mean
from grpo_cli.objective.entropy import entropy_mask
from grpo_cli.objective.importance import is_correction_weights
from grpo_cli.objective.kl import KL_ESTIMATES
from grpo_cli.objective.options import choose
from grpo_cli.objective.settings import LossSettings
from grpo_cli.objective.surrogate import SURROGATES, Surrogate, importance_ratio

# loss_fn(logp, old_logp, ref_logp, advantages, mask, sampling_logp=None, entropy=None) -> (loss, stats): one
# micro-batch's share of the batch loss (`Loss.for_batch`)
LossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]


@runtime_checkable
class Loss(Protocol):
    """What the update asks of a loss: what it reads besides the policy's log-probs, so that `update.prepare`
    computes only that, the names of its stats, and its function for one batch. `GRPOLoss` is one; a loss of
    another class (the `algo.loss` node's `_target_`, built with the run's `LossSettings`) declares the same."""

    @property
    def needs_reference(self) -> bool:
        """The loss reads the reference policy's log-probs (β > 0): one more forward of the batch."""

    @property
    def needs_old_logprobs(self) -> bool:
        """The loss reads the sampling-time policy's log-probs (π_old of the ratio): with μ > 1 updates per rollout
        they are computed before the first; with μ = 1 they are the current policy's, detached."""

    @property
    def needs_entropy(self) -> bool:
        """loss_fn reads `entropy` [n, T], the policy's token entropies."""

    @property
    def needs_entropy_grad(self) -> bool:
        """... and differentiates it (an entropy bonus): the forward keeps its graph."""

    @property
    def entropy_quantile(self) -> float | None:
        """q < 1: the loss keeps the top q of tokens by entropy, over the whole batch (all ranks): the update computes
        that threshold before the first pass; None: no such mask."""

    def stat_names(self, with_sampling_logp: bool) -> list[str]:
        """The keys of loss_fn's stats, in order."""

    def for_batch(self, num_sequences: int, num_tokens: torch.Tensor, max_completion_length: int,
                  entropy_threshold: torch.Tensor | float | None = None) -> LossFn:
        """loss_fn bound to what one update's batch knows."""


def _check_variant(surrogate: Surrogate, settings: LossSettings) -> None:
    """The settings a loss_type's own term reads are given; one that makes its own ratio (GMPO) takes token ratios."""
    loss_type, level = settings.loss_type, settings.importance_sampling_level
    missing = [k for k in surrogate.reads if getattr(settings, k) is None]
    if missing:
        raise ValueError(f"loss_type={loss_type!r} reads {', '.join(missing)}: pass them (algo.{missing[0]})")
    if surrogate.own_ratio and level != "token":
        raise ValueError(f"loss_type={loss_type!r} makes its own sequence ratio from the token ratios: "
                         "use importance_sampling_level='token'")


def _check_loss_inputs(logp, old_logp, ref_logp, advantages, mask, entropy, settings: LossSettings, *, aggregation,
                       normalizer, entropy_threshold) -> None:
    """`grpo_loss`'s shapes, and the arguments that only make sense together."""
    beta, loss_type = settings.beta, settings.loss_type
    entropy_coef, top_entropy_quantile = settings.entropy_coef, settings.top_entropy_quantile
    if logp.dim() != 2:
        raise ValueError(f"logp must be [N, T], got shape {tuple(logp.shape)}")
    n, t = logp.shape
    for name, x in (("old_logp", old_logp), ("ref_logp", ref_logp), ("mask", mask)):
        if x is not None and x.shape != logp.shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, logp has {tuple(logp.shape)}")
    if advantages.shape not in ((n,), (n, t)):
        raise ValueError(f"advantages must be [N] or [N, T] = [{n}] or [{n}, {t}], got {tuple(advantages.shape)}")
    if beta != 0 and ref_logp is None:
        raise ValueError(f"beta ({beta}) > 0 needs ref_logp: pass the reference log-probs or set beta=0")
    if normalizer is not None and not aggregation.reads_normalizer:
        readers = " or ".join(f"loss_type={k!r}" for k, a in AGGREGATIONS.items() if a.reads_normalizer)
        raise ValueError(
            f"normalizer is only used by {readers}, not {loss_type!r}: for gradient accumulation "
            "with the other loss types, weight each micro-batch's loss instead"
        )
    if entropy is None and (entropy_coef != 0 or top_entropy_quantile != 1):
        raise ValueError(f"entropy_coef ({entropy_coef}) and top_entropy_quantile ({top_entropy_quantile}) read "
                         "the entropy: pass entropy=[N, T] entropies of the policy, or set entropy_coef=0 and "
                         "top_entropy_quantile=1.0")
    if entropy is not None and entropy.shape != logp.shape:
        raise ValueError(f"entropy has shape {tuple(entropy.shape)}, logp has {tuple(logp.shape)}")
    if (entropy_coef != 0 and torch.is_grad_enabled() and logp.requires_grad
            and not entropy.requires_grad):
        raise ValueError(f"entropy_coef ({entropy_coef}) needs an entropy with a gradient: a detached one adds "
                         "a constant to the loss and nothing to the update; compute it from the logits with grad")
    if entropy_threshold is not None and top_entropy_quantile == 1:
        raise ValueError("entropy_threshold is only read when top_entropy_quantile < 1")


def _loss_stats(ratio: torch.Tensor, weighed: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                kl: torch.Tensor | None, kept: torch.Tensor | None, surrogate: Surrogate,
                settings: LossSettings) -> dict[str, torch.Tensor]:
    """`grpo_loss`'s stats, detached 0-dim tensors; mask [N, T] in logp's dtype; `weighed` the ratio the term used."""
    with torch.no_grad():
        r = weighed.detach()
        clip = surrogate.clipped(ratio.detach(), advantages, mask, settings)
        stats = {
            "kl": masked_mean(kl.detach(), mask) if kl is not None else mask.new_zeros(()),
            "clip_ratio/low_mean": clip.low,
            "clip_ratio/high_mean": clip.high,
            "clip_ratio/region_mean": clip.region,
            "ratio_mean": masked_mean(r, mask),
        }
        if kept is not None:
            stats["entropy_mask/kept_mean"] = masked_mean(kept.to(mask.dtype), mask)
    return stats


def grpo_loss(
    logp: torch.Tensor, old_logp: torch.Tensor | None, ref_logp: torch.Tensor | None, advantages: torch.Tensor,
    mask: torch.Tensor, settings: LossSettings | None = None, *, max_completion_length: int | None = None,
    normalizer: torch.Tensor | float | None = None, is_weight: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None, entropy_threshold: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped GRPO surrogate with a KL penalty -> (loss to minimize, stats).

    logp, old_logp, ref_logp, mask: [N, T] (mask bool, int or float; nonzero = the token counts, the values
    are not used as weights); advantages: [N] (outcome, broadcast over T) or [N, T] (process); `settings` the
    scalars below (β, ε_low, ε_high, loss_type, ...; None: `LossSettings()`, the paper's). Per token:
        ρ = importance_ratio(logp, old_logp)                      (`importance_sampling_level`: token or GSPO)
        objective = [H ≥ h_q] · w · min(ρ·A, clip(ρ, 1-ε_low, 1+ε_high)·A) - β·KL(logp, ref_logp) + c·H
    and loss = -AGGREGATIONS[loss_type].reduce(objective) (grpo: the paper's mean per sequence, then over
    the N sequences; bnpo, dr_grpo, dapo: see each). loss_type cispo, sapo, gmpo replace the clipped term by their
    own (`surrogate.SURROGATES`): cispo reads `cispo_cap`, sapo `sapo_temperature_pos/neg` (each None otherwise),
    gmpo ε_low/ε_high as its clip range of the log-ratio (token level only).
    `old_logp` None means old = logp.detach() (one update per rollout: ρ = 1, gradient = policy gradient).
    `ref_logp` may be None when beta == 0.
    `max_completion_length` is read only by dr_grpo, `normalizer` only by dapo and cispo (the token count of the whole
    accumulated batch; passing it with another loss_type is an error). w = `is_weight` [N, T] (None: 1), the
    sampler's importance weight (`is_correction_weights`), weights the clipped term, not the KL.

    GSPO (level "sequence", arXiv 2507.18071) clips s_i on every token of sequence i; its range is
    GSPO_EPSILON_LOW/HIGH, passed as epsilon_low/epsilon_high. Its objective is loss_type grpo; the others
    weight a sequence by its length, which the paper does not. With old_logp None it is the token level.

    `entropy` [N, T], read only (and then required) when entropy_coef c != 0 or top_entropy_quantile q < 1:
    c·H is an entropy bonus aggregated like the objective (verl's entropy_coeff; it needs an entropy with a
    gradient); [H ≥ h_q] keeps the policy-gradient term on the top q of tokens by entropy (`entropy_mask`,
    over this call's tokens unless `entropy_threshold` gives h_q), while KL and bonus stay on every token.

    stats, detached 0-dim tensors: `kl` (masked mean; 0 without ref_logp), `ratio_mean`, the
    `clip_fractions` as `clip_ratio/low_mean`, `clip_ratio/high_mean`, `clip_ratio/region_mean`, and with
    q < 1 `entropy_mask/kept_mean`, the share of counted tokens that kept the policy-gradient term.
    """
    s = (settings or LossSettings()).resolved()          # epsilon_high filled: what the terms read
    aggregation = choose("loss_type", s.loss_type, AGGREGATIONS)
    surrogate = SURROGATES[s.loss_type]
    _check_variant(surrogate, s)
    kl_estimate = choose("kl_estimator", s.kl_estimator, KL_ESTIMATES)
    _check_loss_inputs(logp, old_logp, ref_logp, advantages, mask, entropy, s, aggregation=aggregation,
                       normalizer=normalizer, entropy_threshold=entropy_threshold)
    beta, entropy_coef, top_entropy_quantile = s.beta, s.entropy_coef, s.top_entropy_quantile
    keep = mask.bool()                                   # [N, T]
    m = keep.to(logp.dtype)
    # masked positions are set to 0 before any exp, so pad garbage (even ±inf) reaches neither
    # the loss nor the gradient
    lp = logp.masked_fill(~keep, 0.0)
    old = lp.detach() if old_logp is None else old_logp.detach().masked_fill(~keep, 0.0)
    adv = advantages.detach().to(logp.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(1)                           # [N, 1], broadcast over T
    adv = torch.where(keep, adv, 0.0)                    # [N, T]

    ratio = importance_ratio(lp, old, keep, s.importance_sampling_level)   # [N, T]
    objective, weighed = surrogate.term(ratio, lp, old, adv, keep, s)
    if is_weight is not None:
        objective = objective * torch.where(keep, is_weight.detach().to(logp.dtype), 0.0)
    kept = None
    if top_entropy_quantile != 1:  # (entropy_mask rejects a q outside (0, 1])
        kept = entropy_mask(entropy, keep, top_entropy_quantile, threshold=entropy_threshold)   # [N, T]
        objective = torch.where(kept, objective, 0.0)
    kl = None
    if ref_logp is not None:
        ref = ref_logp.detach().masked_fill(~keep, 0.0)
        with torch.set_grad_enabled(torch.is_grad_enabled() and beta != 0):
            kl = kl_estimate(lp, ref)                    # [N, T]; 0 on masked positions
        if beta != 0:
            objective = objective - beta * kl
    if entropy_coef != 0:
        objective = objective + entropy_coef * entropy.to(logp.dtype).masked_fill(~keep, 0.0)
    loss = -aggregation.reduce(objective * m, m, max_completion_length, normalizer)   # objective 0 where masked
    return loss, _loss_stats(ratio, weighed, adv, m, kl, kept, surrogate, s)


class GRPOLoss:
    """`grpo_loss` with its `LossSettings` bound once (the class the `algo.loss` config node names); a `Loss`.

    `for_batch(...)` binds what one update's batch knows (its sequence and token counts, the
    padded completion length) and returns `loss_fn(logp, old_logp, ref_logp, advantages, mask,
    sampling_logp=None, entropy=None)`, whose loss is the micro-batch's share of the batch loss: the micro-batch
    losses of a batch add up to the batch loss, so their gradients add up to the batch gradient.

    `sampling_logp` [n, T]: the rollout engine's own log-probs of the sampled tokens (vLLM), or None.
    With it, the stats hold `sampler/logp_gap`, the mean |old_logp - sampling_logp| over the
    counted tokens; with `is_correction_cap` too, each token's clipped term is weighted by
    `is_correction_weights(old_logp, sampling_logp, mask, cap=is_correction_cap, mode=is_correction,
    low=is_correction_min)`
    (token_truncate: `truncated_is_weight`) and `sampler/is_weight_mean`, `sampler/is_truncated_share`
    and `sampler/is_masked_share` are logged.

    `importance_sampling_level="sequence"` is GSPO (see `grpo_loss`). Its ratio and the sequence IS
    weights are functions of one row each, so a micro-batch of whole rows computes the same values as
    the batch and the micro-batch losses still add up to the batch loss.

    `entropy` [n, T] (needed when `needs_entropy`; differentiable when entropy_coef != 0): the entropy
    bonus and the top-entropy mask of `grpo_loss`. The bonus adds up over micro-batches; the mask's
    quantile does only when `for_batch` gets `entropy_threshold`, the batch's
    `high_entropy_threshold(entropy, mask, top_entropy_quantile)` over all ranks; without it each call
    takes the quantile of its own tokens (TRL's choice).
    """

    def __init__(self, settings: LossSettings):
        self.settings = settings

    @property
    def needs_reference(self) -> bool:
        """β > 0: the loss reads reference log-probs; β = 0 skips the reference forward."""
        return self.settings.beta != 0

    @property
    def needs_old_logprobs(self) -> bool:
        """Always: every loss_type's term is a function of the ratio π_θ / π_old."""
        return True

    @property
    def needs_entropy(self) -> bool:
        """entropy_coef != 0 or top_entropy_quantile < 1: loss_fn reads `entropy` (with a gradient for the bonus)."""
        return self.needs_entropy_grad or self.entropy_quantile is not None

    @property
    def needs_entropy_grad(self) -> bool:
        """entropy_coef != 0: the entropy bonus differentiates the entropy."""
        return self.settings.entropy_coef != 0

    @property
    def entropy_quantile(self) -> float | None:
        """top_entropy_quantile, when it is < 1 (the top-entropy mask); None: every token keeps its term."""
        q = self.settings.top_entropy_quantile
        return q if q < 1 else None

    def stat_names(self, with_sampling_logp: bool) -> list[str]:
        """The keys of `loss_fn`'s stats, in order (`grpo_loss`'s, then the sampler's when it gave its own
        log-probs): the update logs all of them, on a rank with no row to update too."""
        names = ["kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "ratio_mean"]
        if self.entropy_quantile is not None:
            names.append("entropy_mask/kept_mean")
        if with_sampling_logp:
            names.append("sampler/logp_gap")
            if self.settings.is_correction_cap is not None:
                names += ["sampler/is_weight_mean", "sampler/is_truncated_share", "sampler/is_masked_share"]
        return names

    def for_batch(self, num_sequences: int, num_tokens: torch.Tensor, max_completion_length: int,
                  entropy_threshold: torch.Tensor | float | None = None) -> LossFn:
        s = self.settings
        aggregation = choose("loss_type", s.loss_type, AGGREGATIONS)

        def loss_fn(logp, old_logp, ref_logp, advantages, mask, sampling_logp=None, entropy=None):
            correction = is_weight = None
            old = logp.detach() if old_logp is None else old_logp.detach()  # [n, T]: π_old, the trainer's
            if sampling_logp is not None and s.is_correction_cap is not None:
                correction = is_correction_weights(old, sampling_logp, mask, cap=s.is_correction_cap,
                                                   mode=s.is_correction, low=s.is_correction_min)
                is_weight = correction.weight
            loss, stats = grpo_loss(
                logp, old_logp, ref_logp, advantages, mask, s, max_completion_length=max_completion_length,
                normalizer=num_tokens if aggregation.reads_normalizer else None, is_weight=is_weight,
                entropy=entropy, entropy_threshold=entropy_threshold)
            if sampling_logp is not None:
                m = mask.to(logp.dtype)
                stats["sampler/logp_gap"] = masked_mean((old - sampling_logp).abs(), m)
                if correction is not None:
                    stats["sampler/is_weight_mean"] = masked_mean(is_weight, m)
                    stats["sampler/is_truncated_share"] = correction.truncated_share
                    stats["sampler/is_masked_share"] = correction.masked_share
            weight = aggregation.micro_batch_weight(logp.shape[0], num_sequences, mask.sum(), num_tokens)
            return loss * weight, stats

        return loss_fn
