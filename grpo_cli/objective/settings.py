"""`LossSettings`: the loss's hyper-parameters, named once, as one frozen record of scalars.

Each field is the `algo` key of the same name (conf/algo/grpo.yaml holds its value and says what it does;
grpo_cli/algo.py reads the record once from the section and checks every field before a model loads). The loss
(`grpo_loss`, `GRPOLoss`) and the per-token terms (`surrogate.SURROGATES`) read their values from it.

A run's settings all come from its `algo` section (a run saved before one existed has it from runs.upgrade). The
defaults serve code that builds a loss by hand (the tests, scripts/loss_vs_trl.py): DeepSeekMath's §4.1 values
(β 0.04, ε 0.2, k3, the per-sequence mean), and for each setting added since, the value that turns it off.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class LossSettings:
    """The loss's scalars (algo.*); a loss_type's own settings (cispo_cap, sapo_temperature_*) are read only by it."""

    beta: float = 0.04  # β, the KL term's weight; 0: no reference log-probs
    epsilon_low: float = 0.2  # ε: the clip's lower side 1 - ε_low (gmpo: the log-ratio's -ε_low)
    epsilon_high: float | None = None  # the clip's upper side 1 + ε_high; None: ε_low
    kl_estimator: str = "k3"  # kl.KL_ESTIMATES
    loss_type: str = "grpo"  # aggregation.AGGREGATIONS and surrogate.SURROGATES
    importance_sampling_level: str = "token"  # token (PPO's ratio) or sequence (GSPO's)
    is_correction_cap: float | None = None  # the sampler's IS weight's cap; None: no weight
    is_correction: str = "token_truncate"  # importance.IS_CORRECTIONS
    is_correction_min: float | None = None  # the mask modes' lower bound; None: 1 / is_correction_cap
    entropy_coef: float = 0.0  # the entropy bonus's weight; 0: off
    top_entropy_quantile: float = 1.0  # the share of highest-entropy tokens that keep the policy gradient
    cispo_cap: float | None = None  # cispo: the cap of its IS weight
    sapo_temperature_pos: float | None = None  # sapo: the gate's temperature where Â > 0
    sapo_temperature_neg: float | None = None  # sapo: the gate's temperature where Â <= 0

    @property
    def clip_high(self) -> float:
        """ε_high, or ε_low where it is None (the symmetric clip)."""
        return self.epsilon_low if self.epsilon_high is None else self.epsilon_high

    def resolved(self) -> LossSettings:
        """These settings with epsilon_high filled (`clip_high`): what the per-token terms read."""
        return dataclasses.replace(self, epsilon_high=self.clip_high)


# the field names, in order: the `algo` keys that are loss settings
LOSS_SETTINGS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(LossSettings))
