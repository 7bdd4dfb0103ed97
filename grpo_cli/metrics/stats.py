"""A step's reward and completion statistics (`reward`, `reward_std`, `rewards/NAME/mean`,
`completions/mean_length` ...), named as TRL names them, the mean that leaves missing scores out, and the Wilson
interval of an accuracy."""

from __future__ import annotations

import math

import torch


def mean(values) -> float:
    """Mean of the numbers that are present (None/NaN left out); NaN when none are."""
    kept = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    return sum(kept) / len(kept) if kept else float("nan")


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of `successes` of `n` (z = 1.96: 95%); (NaN, NaN) when n = 0. Unlike p ± z·SE it
    stays within [0, 1] and is not empty at 0 or n successes."""
    if n == 0:
        return math.nan, math.nan
    p, z2 = successes / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def rollout_metrics(result, rollout, group_size: int) -> dict:
    """Reward and completion statistics, named as TRL names them; `rollout`: a Rollout, or its Tally (every rank's
    rows: lengths, truncation, episodes' counts)."""
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
        # completions the function gave no score (a judge that failed, a missing reference): the mean leaves them out
        out[f"rewards/{name}/no_score"] = sum(v is None for v in values)
    out.update({"completions/mean_length": sum(lengths) / len(lengths), "completions/max_length": max(lengths),
                "completions/clipped_ratio": sum(rollout.truncated) / len(lengths)})
    episodes = rollout.episodes  # multi-turn episodes (env=tools or class) or their counts; None otherwise
    if episodes:
        out.update(episode_metrics(episodes))
    return out


def episode_metrics(episodes: list) -> dict:
    """Tool calls per episode, the share of calls that failed, assistant turns per episode, and the share of the
    completions' tokens the environment added (tool results and turn markers: context, not scored)."""
    calls, failures = sum(e.tool_calls for e in episodes), sum(e.tool_failures for e in episodes)
    tokens = sum(len(e.sampled) for e in episodes)
    return {"tools/call_frequency": calls / len(episodes), "tools/failure_frequency": failures / max(calls, 1),
            "turns/mean": sum(e.turns for e in episodes) / len(episodes),
            "tokens/environment_share": (tokens - sum(sum(e.sampled) for e in episodes)) / max(tokens, 1)}
