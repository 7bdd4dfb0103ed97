"""The GRPO math: advantages, KL estimators and the clipped loss, as pure functions named after the paper.

Pure functions of tensors and scalars: no model, no config object, no I/O (the `algo` settings they take
are checked once, in config.ALGO, before a model loads). The trainer calls them in the order a step
walks: `outcome_advantages` / `process_advantages` on the rewards of a rollout, then `grpo_loss` on the
policy's log-probs (`logprobs`, through the kernels of `kernels`). `grpo_loss` reads as the formula:

    ρ = importance_ratio(logp, old)                       # π_θ / π_old, per token or per sequence (GSPO)
    objective = clipped_surrogate(ρ, Â, ε_low, ε_high)    # min(ρ·Â, clip(ρ, 1-ε_low, 1+ε_high)·Â)
              · is_weight · [H ≥ h_q]                     # sampler IS weight; top-entropy mask
              - β·KL(π_θ || π_ref) + entropy_coef·H       # kl_divergence; entropy bonus
    loss = -AGGREGATIONS[loss_type].reduce(objective)      # over tokens and sequences
    stats: KL, ratio, clip_fractions(ρ, Â, ...)

A loss variant that aggregates differently is one function and its entry in `AGGREGATIONS` (and its
word in conf/algo/grpo.yaml's loss_type comment). An unknown name (loss_type, kl_estimator, ...) fails
in `choose`, which names the allowed values.

What follows DeepSeekMath (arXiv 2402.03300) §4.1:
  - outcome supervision: Â_i,t = (r_i - mean(r)) / std(r) over the G completions of a prompt,
    with the population std (1/G) of the paper's formula;
  - process supervision: every step reward is normalized by the mean and std of all step rewards
    of the group, and a token's advantage is the sum of the normalized rewards of the steps that
    end at or after it;
  - the KL to the reference policy is the paper's unbiased estimator (k3 below), added to the
    per-token objective (not to the reward), weighted by β;
  - the `grpo` aggregation 1/G Σ_i 1/|o_i| Σ_t.

Where it departs, and why:
  - `eps` is added to the std (the paper has none) so a group whose rewards are all equal gets
    advantage 0 instead of 0/0;
  - a NaN reward means "no score" (a reward model that failed, a filtered sample): it is left out of
    the group's mean and std and its completion gets advantage 0;
  - options the paper does not have, each from a follow-up: `std="sample"` (TRL, verl),
    `scale="batch"` (std of the whole batch) and `scale="none"` (Dr. GRPO), an asymmetric clip
    range `epsilon_high` (DAPO's clip-higher), and the aggregations `bnpo`, `dr_grpo`, `dapo`;
  - `importance_sampling_level="sequence"`: GSPO's sequence-level ratio (arXiv 2507.18071), in its
    GSPO-token form so that per-token (process) advantages still work;
  - importance weights for a rollout engine with its own copy of the policy (vLLM): truncated per
    token, truncated per sequence, or masked per sequence (`is_correction_weights`; TRL, verl);
  - an entropy bonus `entropy_coef` (verl's entropy_coeff) and `top_entropy_quantile`: only the
    highest-entropy tokens carry the policy-gradient term (arXiv 2506.01939, TRL);
  - in the `grpo` aggregation a sequence with no unmasked token (e.g. a truncated completion whose
    loss is masked out) contributes 0 but still counts in the mean over the N sequences, so the
    weight of the other sequences does not depend on how many were masked.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import torch

# GSPO's clip range (arXiv 2507.18071 v2, §5.1; TRL's paper index uses the same): the sequence ratio is a
# geometric mean of token ratios, so it strays from 1 far less than a token ratio and needs a range ~1000x
# narrower than PPO's 0.2
GSPO_EPSILON_LOW = 3e-4
GSPO_EPSILON_HIGH = 4e-4

Option = TypeVar("Option")


def choose(setting: str, name: str, options: Mapping[str, Option]) -> Option:
    """options[name]; an unknown name is a ValueError naming the setting and the allowed names.

    The one check of a name in this module: the config's were checked before the model loaded (config.ALGO),
    this is for a caller of the functions themselves.
    """
    if name not in options:
        raise ValueError(f"{setting} ({name!r}) must be one of {tuple(options)}")
    return options[name]


# --------------------------------------------------------------------------- advantages


def _group_std(r0: torch.Tensor, valid: torch.Tensor, centered: torch.Tensor, ddof: int) -> torch.Tensor:
    """[groups, G] -> [groups, 1]: the std of each group's scored rewards (the paper's)."""
    count = valid.sum(1, keepdim=True)                   # [groups, 1]
    return (centered.pow(2).sum(1, keepdim=True) / (count - ddof).clamp(min=1)).sqrt()


def _batch_std(r0: torch.Tensor, valid: torch.Tensor, centered: torch.Tensor, ddof: int) -> torch.Tensor:
    """[groups, G] -> 0-dim: the std of every scored reward of the batch, about the batch mean (TRL's
    scale_rewards="batch")."""
    scored = r0[valid]                                   # [scored rewards]
    centered_batch = scored - scored.mean() if scored.numel() else scored
    return (centered_batch.pow(2).sum() / max(scored.numel() - ddof, 1)).sqrt()


# scale -> the std an advantage is divided by (none: not divided, Dr. GRPO)
ADVANTAGE_SCALES: dict[str, Callable[..., torch.Tensor] | None] = {"group": _group_std, "batch": _batch_std,
                                                                   "none": None}
SCALES = tuple(ADVANTAGE_SCALES)
# std -> the degrees of freedom it subtracts: population 1/G (the paper's formula), sample 1/(G-1) (TRL, verl)
STD_DDOF = {"population": 0, "sample": 1}
STDS = tuple(STD_DDOF)


def outcome_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    scale: str = "group",
    std: str = "population",
    eps: float = 1e-4,
) -> torch.Tensor:
    """[N] rewards, groups of `group_size` contiguous completions -> [N] advantages.

    (r_i - group mean) / (std + eps). `scale`: "group" (paper) divides by the std of the group,
    "batch" by the std of all rewards of the batch (the mean stays per group), "none" does not
    divide. `std`: "population" (1/G, the paper's formula) or "sample" (1/(G-1), TRL and verl).
    NaN rewards are left out of every mean and std and get advantage 0.
    """
    std_of = choose("scale", scale, ADVANTAGE_SCALES)
    ddof = choose("std", std, STD_DDOF)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size ({group_size}) must be >= 1")
    n = rewards.numel()
    if n % group_size:
        raise ValueError(
            f"number of rewards ({n}) is not a multiple of group_size ({group_size}): "
            "each prompt needs exactly group_size completions, stored contiguously"
        )
    dtype = rewards.dtype if rewards.is_floating_point() else torch.get_default_dtype()
    # float64 inside: the variance of rewards of ±1e30 overflows float32 (and would zero the advantages)
    r = rewards.to(torch.float64).reshape(-1, group_size)  # [groups, G]
    valid = ~torch.isnan(r)                              # [groups, G]; False = no score
    r0 = torch.where(valid, r, 0.0)
    count = valid.sum(1, keepdim=True)                   # [groups, 1]
    mean = r0.sum(1, keepdim=True) / count.clamp(min=1)  # [groups, 1]; 0 for an all-NaN group
    centered = torch.where(valid, r0 - mean, 0.0)        # [groups, G]; 0 where no score
    if std_of is None:
        return centered.view(-1).to(dtype)
    return (centered / (std_of(r0, valid, centered, ddof) + eps)).view(-1).to(dtype)


def process_advantages(
    step_rewards: Sequence[Sequence[float]],
    step_ends: Sequence[Sequence[int]],
    group_size: int,
    length: int,
    *,
    eps: float = 1e-4,
) -> torch.Tensor:
    """Per-step rewards of N completions -> [N, length] per-token advantages (DeepSeekMath §4.1.3).

    `step_rewards[i]` are the K_i step rewards of completion i, `step_ends[i]` the completion-token
    index of the last token of each step (non-decreasing, < length: several steps may end on one token,
    each counted on its own in the group's mean and std, e.g. a final answer's step and the reference
    steps a completion never wrote, all at its last token). Within each group every
    step reward is normalized by the mean and population std of all step rewards of the group;
    token t of completion i gets the sum of its normalized step rewards whose step ends at or after
    t, so tokens after the last step end get 0. NaN step rewards are left out like NaN outcome
    rewards (normalized to 0). Returns float32 (the default dtype) on the CPU.
    """
    n = len(step_rewards)
    if len(step_ends) != n:
        raise ValueError(f"step_rewards has {n} completions but step_ends has {len(step_ends)}")
    if group_size < 1:
        raise ValueError(f"group_size ({group_size}) must be >= 1")
    if n % group_size:
        raise ValueError(
            f"number of completions ({n}) is not a multiple of group_size ({group_size}): "
            "each prompt needs exactly group_size completions, stored contiguously"
        )
    if length < 0:
        raise ValueError(f"length ({length}) must be >= 0")
    rows, ends, values = [], [], []
    for i, (rs, es) in enumerate(zip(step_rewards, step_ends)):
        if len(rs) != len(es):
            raise ValueError(f"completion {i} has {len(rs)} step rewards but {len(es)} step ends")
        prev = -1
        for e in es:
            if int(e) != e or e < prev or e < 0 or e >= length:
                raise ValueError(
                    f"completion {i}: step ends {list(es)} must be integers, non-decreasing, "
                    f"in [0, {length}) (token indices within the completion)"
                )
            prev = e
        rows += [i] * len(rs)
        ends += [int(e) for e in es]
        values += [float(v) for v in rs]

    dtype = torch.get_default_dtype()
    out = torch.zeros(n, length, dtype=dtype)            # [N, length]
    if not values:
        return out
    row = torch.tensor(rows)                             # [S]; S = all steps of the batch
    end = torch.tensor(ends)                             # [S]
    r = torch.tensor(values, dtype=dtype)                # [S]
    group = row // group_size                            # [S]
    groups = n // group_size

    valid = ~torch.isnan(r)
    r0 = torch.where(valid, r, 0.0)
    count = torch.zeros(groups, dtype=dtype).index_add_(0, group, valid.to(dtype))   # [groups]
    mean = torch.zeros(groups, dtype=dtype).index_add_(0, group, r0) / count.clamp(min=1)
    centered = torch.where(valid, r0 - mean[group], 0.0)                             # [S]
    var = torch.zeros(groups, dtype=dtype).index_add_(0, group, centered.pow(2)) / count.clamp(min=1)
    normalized = centered / (var.sqrt()[group] + eps)                                # [S]

    # each normalized step reward at its last token, then Â[:, t] = Σ_{end ≥ t}: a reverse cumsum
    out.index_put_((row, end), normalized, accumulate=True)
    return out.flip(1).cumsum(1).flip(1)


# --------------------------------------------------------------------------- KL and ratio


def _k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


def _k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref_logp).pow(2)


def _k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    d = ref_logp - logp
    return torch.expm1(d) - d                            # = exp(d) - 1 - d, exact near d = 0


KL_ESTIMATES = {"k1": _k1, "k2": _k2, "k3": _k3}
KL_ESTIMATORS = tuple(KL_ESTIMATES)


def kl_divergence(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(π_θ || π_ref) from log-probs of the sampled tokens (elementwise).

    k1 = logp - ref_logp (unbiased, can be negative); k2 = ½(logp - ref_logp)²;
    k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1 (the paper's eq. 4: unbiased and >= 0).
    No clamping: a large gap gives a large value.
    """
    return choose("kl_estimator", estimator, KL_ESTIMATES)(logp, ref_logp)


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


# --------------------------------------------------------------------------- the clipped surrogate


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


# --------------------------------------------------------------------------- aggregation by loss_type
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
}
LOSS_TYPES = tuple(AGGREGATIONS)


# --------------------------------------------------------------------------- entropy: the top-entropy mask


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


# --------------------------------------------------------------------------- the loss


def _check_loss_inputs(logp, old_logp, ref_logp, advantages, mask, entropy, *, beta, loss_type, aggregation,
                       normalizer, entropy_coef, top_entropy_quantile, entropy_threshold) -> None:
    """`grpo_loss`'s shapes, and the arguments that only make sense together."""
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


def _loss_stats(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None,
                kept: torch.Tensor | None, epsilon_low: float, epsilon_high: float) -> dict[str, torch.Tensor]:
    """`grpo_loss`'s stats, detached 0-dim tensors; mask [N, T] in logp's dtype."""
    with torch.no_grad():
        r = ratio.detach()
        clip = clip_fractions(r, advantages, mask, epsilon_low, epsilon_high)
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
    mask: torch.Tensor, *, beta: float = 0.04, epsilon_low: float = 0.2, epsilon_high: float | None = None,
    kl_estimator: str = "k3", loss_type: str = "grpo", max_completion_length: int | None = None,
    normalizer: torch.Tensor | float | None = None, is_weight: torch.Tensor | None = None,
    importance_sampling_level: str = "token", entropy: torch.Tensor | None = None, entropy_coef: float = 0.0,
    top_entropy_quantile: float = 1.0, entropy_threshold: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped GRPO surrogate with a KL penalty -> (loss to minimize, stats).

    logp, old_logp, ref_logp, mask: [N, T] (mask bool, int or float; nonzero = the token counts, the values
    are not used as weights); advantages: [N] (outcome, broadcast over T) or [N, T] (process). Per token:
        ρ = importance_ratio(logp, old_logp)                      (`importance_sampling_level`: token or GSPO)
        objective = [H ≥ h_q] · w · min(ρ·A, clip(ρ, 1-ε_low, 1+ε_high)·A) - β·KL(logp, ref_logp) + c·H
    and loss = -AGGREGATIONS[loss_type].reduce(objective) (grpo: the paper's mean per sequence, then over
    the N sequences; bnpo, dr_grpo, dapo: see each). `old_logp` None means old = logp.detach() (one update
    per rollout: ρ = 1, gradient = policy gradient). `ref_logp` may be None when beta == 0.
    `max_completion_length` is read only by dr_grpo, `normalizer` only by dapo (the token count of the whole
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
    aggregation = choose("loss_type", loss_type, AGGREGATIONS)
    kl_estimate = choose("kl_estimator", kl_estimator, KL_ESTIMATES)
    _check_loss_inputs(logp, old_logp, ref_logp, advantages, mask, entropy, beta=beta, loss_type=loss_type,
                       aggregation=aggregation, normalizer=normalizer, entropy_coef=entropy_coef,
                       top_entropy_quantile=top_entropy_quantile, entropy_threshold=entropy_threshold)
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
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

    ratio = importance_ratio(lp, old, keep, importance_sampling_level)   # [N, T]
    objective = clipped_surrogate(ratio, adv, epsilon_low, eps_high)
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
    return loss, _loss_stats(ratio, adv, m, kl, kept, epsilon_low, eps_high)


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
    masked_share: torch.Tensor      # 0-dim: tokens of sequences outside [1/cap, cap] (sequence_mask; else 0)


# Each: (d [N, T] = log π_old - log π_sampler, 0 on masked positions; keep [N, T] bool; m [N, T] float; cap)
# -> ISWeights


def _token_truncate(d: torch.Tensor, keep: torch.Tensor, m: torch.Tensor, cap: float) -> ISWeights:
    raw = torch.exp(d)                                   # [N, T]
    weight = torch.where(keep, raw.clamp(max=cap), 0.0)
    return ISWeights(weight, masked_mean((raw > cap).to(m.dtype), m), m.new_zeros(()))


def _sequence_truncate(d: torch.Tensor, keep: torch.Tensor, m: torch.Tensor, cap: float) -> ISWeights:
    raw = torch.exp(d.sum(1, keepdim=True))              # [N, 1]; inf past ~e^709 (float64): capped all the same
    weight = torch.where(keep, raw.clamp(max=cap), 0.0)
    return ISWeights(weight, masked_mean((raw > cap).expand_as(m).to(m.dtype), m), m.new_zeros(()))


def _sequence_mask(d: torch.Tensor, keep: torch.Tensor, m: torch.Tensor, cap: float) -> ISWeights:
    if cap < 1:
        raise ValueError(f"cap ({cap}) must be >= 1 for sequence_mask: the band [1/cap, cap] must hold 1")
    log_w = d.sum(1, keepdim=True)                       # [N, 1]; log π_old(o_i) / π_sampler(o_i)
    inside = log_w.abs() <= math.log(cap)                # [N, 1]; in log space: symmetric, no overflow
    weight = torch.where(keep & inside, torch.exp(log_w), 0.0)
    return ISWeights(weight, m.new_zeros(()), masked_mean((~inside).expand_as(m).to(m.dtype), m))


IS_CORRECTION_MODES = {"token_truncate": _token_truncate, "sequence_truncate": _sequence_truncate,
                       "sequence_mask": _sequence_mask}
IS_CORRECTIONS = tuple(IS_CORRECTION_MODES)


def is_correction_weights(old_logp: torch.Tensor, sampling_logp: torch.Tensor, mask: torch.Tensor, *,
                          cap: float, mode: str = "token_truncate") -> ISWeights:
    """Importance weights π_old / π_sampler for each token's clipped term: [N, T] log-probs -> `ISWeights`.

    π_sampler is the rollout engine's copy of the policy (vLLM), π_old the trainer's; with
    d_i,t = old_i,t - sampler_i,t over the unmasked tokens:
        token_truncate     w_i,t = min(exp(d_i,t), cap)             (`truncated_is_weight`; TRL's default mode)
        sequence_truncate  w_i   = min(exp(Σ_t d_i,t), cap)         on every token of sequence i
        sequence_mask      w_i   = exp(Σ_t d_i,t) if it lies in [1/cap, cap], else 0: the sequence leaves
                                   the policy-gradient term (its KL term stays, and it still counts in
                                   every aggregation's denominator, as in TRL)
    The sequence ratio is the ratio of the sequence's probabilities, π_old(o_i) / π_sampler(o_i) = exp(Σ_t d),
    a sum in the exponent, not a mean: TRL (vllm_importance_sampling_mode="sequence_*" sums the per-token
    differences) and verl (rollout_is_level="sequence"; its "geometric" level is the mean) both do so. It
    grows with the length: a gap of 1e-3 per token is a factor e over 1,000 tokens, so a sequence cap is
    set larger than a token cap (verl suggests 2-10 against 1.5-5). The mask band [1/cap, cap] is verl's
    (rollout_is_mode="mask", lower bound 1/upper by default; TRL masks only above cap); inside it the
    weight is the ratio itself, as in both (masked importance sampling), not 1. Masked positions (even
    NaN) reach nothing; an empty sequence has ratio 1.
    """
    correction = choose("is_correction", mode, IS_CORRECTION_MODES)
    if not cap > 0:
        raise ValueError(f"cap ({cap}) must be > 0")
    keep = mask.bool()                                   # [N, T]
    m = keep.to(old_logp.dtype)
    d = (old_logp.detach() - sampling_logp.detach()).masked_fill(~keep, 0.0)   # [N, T]; log π_old / π_sampler
    return correction(d, keep, m, cap)


class GRPOLoss:
    """`grpo_loss` with its hyper-parameters bound once (built from the `algo.loss` config node).

    `for_batch(...)` binds what one update's batch knows (its sequence and token counts, the
    padded completion length) and returns `loss_fn(logp, old_logp, ref_logp, advantages, mask,
    sampling_logp=None, entropy=None)`, whose loss is the micro-batch's share of the batch loss: the micro-batch
    losses of a batch add up to the batch loss, so their gradients add up to the batch gradient.

    `sampling_logp` [n, T]: the rollout engine's own log-probs of the sampled tokens (vLLM), or None.
    With it, the stats hold `sampler/logp_gap`, the mean |old_logp - sampling_logp| over the
    counted tokens; with `is_correction_cap` too, each token's clipped term is weighted by
    `is_correction_weights(old_logp, sampling_logp, mask, cap=is_correction_cap, mode=is_correction)`
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

    def __init__(self, beta: float, epsilon_low: float, epsilon_high: float | None, kl_estimator: str,
                 loss_type: str, is_correction_cap: float | None = None, importance_sampling_level: str = "token",
                 is_correction: str = "token_truncate", entropy_coef: float = 0.0, top_entropy_quantile: float = 1.0):
        self.beta = beta
        self.epsilon_low = epsilon_low
        self.epsilon_high = epsilon_high
        self.kl_estimator = kl_estimator
        self.loss_type = loss_type
        self.is_correction_cap = is_correction_cap
        self.importance_sampling_level = importance_sampling_level
        self.is_correction = is_correction
        self.entropy_coef = entropy_coef
        self.top_entropy_quantile = top_entropy_quantile

    @property
    def needs_reference(self) -> bool:
        """β > 0: the loss reads reference log-probs; β = 0 skips the reference forward."""
        return self.beta != 0

    @property
    def needs_entropy(self) -> bool:
        """entropy_coef != 0 or top_entropy_quantile < 1: loss_fn reads `entropy` (with a gradient for the bonus)."""
        return self.entropy_coef != 0 or self.top_entropy_quantile < 1

    def stat_names(self, with_sampling_logp: bool) -> list[str]:
        """The keys of `loss_fn`'s stats, in order (`grpo_loss`'s, then the sampler's when it gave its own
        log-probs): the update logs all of them, on a rank with no row to update too."""
        names = ["kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "ratio_mean"]
        if self.top_entropy_quantile < 1:
            names.append("entropy_mask/kept_mean")
        if with_sampling_logp:
            names.append("sampler/logp_gap")
            if self.is_correction_cap is not None:
                names += ["sampler/is_weight_mean", "sampler/is_truncated_share", "sampler/is_masked_share"]
        return names

    def for_batch(self, num_sequences: int, num_tokens: torch.Tensor, max_completion_length: int,
                  entropy_threshold: torch.Tensor | float | None = None):
        aggregation = choose("loss_type", self.loss_type, AGGREGATIONS)

        def loss_fn(logp, old_logp, ref_logp, advantages, mask, sampling_logp=None, entropy=None):
            correction = is_weight = None
            old = logp.detach() if old_logp is None else old_logp.detach()  # [n, T]: π_old, the trainer's
            if sampling_logp is not None and self.is_correction_cap is not None:
                correction = is_correction_weights(old, sampling_logp, mask, cap=self.is_correction_cap,
                                                   mode=self.is_correction)
                is_weight = correction.weight
            loss, stats = grpo_loss(
                logp, old_logp, ref_logp, advantages, mask, beta=self.beta, epsilon_low=self.epsilon_low,
                epsilon_high=self.epsilon_high, kl_estimator=self.kl_estimator, loss_type=self.loss_type,
                max_completion_length=max_completion_length,
                normalizer=num_tokens if aggregation.reads_normalizer else None, is_weight=is_weight,
                importance_sampling_level=self.importance_sampling_level, entropy=entropy,
                entropy_coef=self.entropy_coef, top_entropy_quantile=self.top_entropy_quantile,
                entropy_threshold=entropy_threshold)
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
