"""The GRPO math: advantages, KL estimators and the clipped loss, as pure functions named after the paper.

Pure functions of tensors and scalars: no model, no config object, no I/O (the `algo` settings they take
come as scalars or as `LossSettings`, a frozen record of them, read and checked once in grpo_cli/algo.py before a
model loads). The trainer calls them in the order a step walks: `outcome_advantages` /
`sparse_process_advantages` on the rewards a rollout's tokens carry (grpo_cli.credit puts them there), then
`grpo_loss` (through `GRPOLoss`) on the policy's log-probs (`logprobs`, through the kernels of `kernels`).

The modules, one part of DeepSeekMath's §4.1 (arXiv 2402.03300) each; each docstring says where it departs:
  advantages    outcome and process advantages (the step rewards as a sparse [N, T] or as lists), the std and scale
                options, RLOO's baseline
  kl            the KL estimators k1, k2, k3
  surrogate     the importance ratio ρ (per token, or GSPO's per sequence), the per-token term of each loss_type
                (PPO's clipped one; CISPO's, SAPO's, GMPO's), clip fractions
  aggregation   masked_mean and the aggregations by loss_type: the per-token objective -> the loss
  entropy       the top-entropy mask
  importance    the sampler's importance weights (vLLM's copy of the policy against the trainer's)
  settings      LossSettings: the loss's scalars, named once
  loss          grpo_loss, composed from the pieces above, GRPOLoss, and Loss (what the update asks of a loss)
  options       choose, the one check of a setting's name

The names below stay importable from here because configs name them (`_target_: grpo_cli.objective.GRPOLoss`
in conf/algo/*.yaml and in saved runs' config.yaml), and so do callers.
"""

from __future__ import annotations

from grpo_cli.objective.advantages import (
    ADVANTAGE_ESTIMATORS,
    ADVANTAGE_SCALES,
    CREDIT_FORMS,
    CREDITS,
    ESTIMATORS,
    SCALES,
    STD_DDOF,
    STDS,
    UNSCALED_ESTIMATORS,
    outcome_advantages,
    process_advantages,
    sparse_process_advantages,
    step_coordinates,
)
from grpo_cli.objective.aggregation import (
    AGGREGATIONS,
    LOSS_TYPES,
    Aggregation,
    accumulated_token_mean,
    constant_length_mean,
    masked_mean,
    per_sequence,
    per_token,
    sequence_mean,
    token_mean,
    whole_batch,
)
from grpo_cli.objective.entropy import entropy_mask, high_entropy_threshold
from grpo_cli.objective.importance import (
    IS_CORRECTION_MODES,
    IS_CORRECTIONS,
    MASK_MODES,
    ISWeights,
    is_correction_weights,
    truncated_is_weight,
)
from grpo_cli.objective.kl import KL_ESTIMATES, KL_ESTIMATORS, kl_divergence
from grpo_cli.objective.loss import GRPOLoss, Loss, LossFn, grpo_loss
from grpo_cli.objective.options import choose
from grpo_cli.objective.settings import LOSS_SETTINGS, LossSettings
from grpo_cli.objective.surrogate import (
    GSPO_EPSILON_HIGH,
    GSPO_EPSILON_LOW,
    IMPORTANCE_RATIOS,
    IMPORTANCE_SAMPLING_LEVELS,
    SURROGATES,
    ClipFractions,
    Surrogate,
    cispo_surrogate,
    clip_fractions,
    clipped_surrogate,
    gmpo_ratio,
    importance_ratio,
    sapo_surrogate,
)

__all__ = [
    "ADVANTAGE_SCALES", "SCALES", "STD_DDOF", "STDS", "outcome_advantages", "process_advantages",
    "sparse_process_advantages", "step_coordinates",
    "ADVANTAGE_ESTIMATORS", "ESTIMATORS", "UNSCALED_ESTIMATORS", "CREDIT_FORMS", "CREDITS",
    "KL_ESTIMATES", "KL_ESTIMATORS", "kl_divergence",
    "GSPO_EPSILON_HIGH", "GSPO_EPSILON_LOW", "IMPORTANCE_RATIOS", "IMPORTANCE_SAMPLING_LEVELS", "importance_ratio",
    "clipped_surrogate", "ClipFractions", "clip_fractions", "cispo_surrogate", "sapo_surrogate", "gmpo_ratio",
    "Surrogate", "SURROGATES",
    "masked_mean", "sequence_mean", "token_mean", "constant_length_mean", "accumulated_token_mean",
    "per_sequence", "per_token", "whole_batch", "Aggregation", "AGGREGATIONS", "LOSS_TYPES",
    "high_entropy_threshold", "entropy_mask",
    "truncated_is_weight", "ISWeights", "IS_CORRECTION_MODES", "IS_CORRECTIONS", "MASK_MODES",
    "is_correction_weights",
    "grpo_loss", "GRPOLoss", "Loss", "LossFn", "LossSettings", "LOSS_SETTINGS", "choose",
]
