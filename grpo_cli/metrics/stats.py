"""A step's reward and completion statistics (`reward`, `reward_std`, `rewards/NAME/mean`,
`completions/mean_length` ...), named as TRL names them, and the mean that leaves missing scores out."""

from __future__ import annotations

import math

import torch


def mean(values) -> float:
    """Mean of the numbers that are present (None/NaN left out); NaN when none are."""
    kept = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    return sum(kept) / len(kept) if kept else float("nan")


def rollout_metrics(result, rollout, group_size: int) -> dict:
    """Reward and completion statistics, named as TRL names them."""
    # [B, G]; NaN = no score
    rewards = torch.tensor([math.nan if r is None else float(r) for r in result.rewards]).view(-1, group_size)
    group_std = torch.stack([row[~row.isnan()].std(unbiased=False) if (~row.isnan()).sum() > 1
                             else torch.tensor(0.0) for row in rewards])
    lengths = rollout.lengths
    out = {"reward": mean(result.rewards), "reward_std": float(group_std.mean()),
           "frac_reward_zero_std": float((group_std < 1e-8).float().mean()),
           "reward_failures": result.failures}
    for name, values in result.per_function.items():
        out[f"rewards/{name}/mean"] = mean(values)
    out.update({"completions/mean_length": sum(lengths) / len(lengths), "completions/max_length": max(lengths),
                "completions/clipped_ratio": sum(rollout.truncated) / len(lengths)})
    return out
