"""The per-token estimators of KL(π_θ || π_ref), from the log-probs of the sampled tokens.

What follows DeepSeekMath (arXiv 2402.03300) §4.1: the KL to the reference policy is the paper's unbiased
estimator, k3 below (how it enters the loss is `loss`'s). Where it departs: k1 and k2 are options the paper
does not have.
"""

from __future__ import annotations

import torch

from grpo_cli.objective.options import choose


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
