"""Which sampled groups a step trains on: all of them, or (dynamic sampling) only those with signal.

    keep = GroupFilter(enabled, filter_metric, max_generation_batches)
    draws = []
    while not keep.done(draws, prompts_per_step, world):                # the trainer's steps 1-3, repeated
        draws.append(Groups(examples, positions, rollout, result, G))   # prompts -> G completions -> rewards
    kept, metrics = keep.select(draws, prompts_per_step, pad, world)    # Groups again; dynamic/... metrics

Dynamic sampling is DAPO's (arXiv 2503.14476, §3.2): a group whose G rewards are all equal has
advantage 0 on every completion and so carries no policy gradient; the step draws fresh prompts until
`prompts_per_step` groups whose `filter_metric` varies are kept (verl's `algorithm.filter_groups`,
OpenRLHF's dynamic filtering). Off, the filter keeps the one draw as it is.

Choices, each where the paper leaves room:
  - the metric is one reward function's raw score (`rewards/<name>`, e.g. `accuracy`), not the shaped
    sum, as verl's `filter_groups.metric`; `reward` filters on the sum. A completion without a score
    does not count, and a group with fewer than 2 scores has no signal;
  - at most `max_generation_batches` draws of `prompts_per_step` prompts a step (verl's
    max_num_gen_batches); when they yield fewer groups with signal, the step trains on those it has
    (`dynamic/batch_full` = 0), and when they yield none at all, on the last draw as it is
    (`dynamic/unfiltered` = 1: with β = 0 its update is a no-op, with β > 0 a KL-only step);
  - the kept groups are the first ones in draw order, across ranks (draw, then rank, then group), so
    every rank agrees; with N ranks they are gathered and dealt out again in equal contiguous shares, so
    every rank trains on the same number of groups (the kept count rounded down to a multiple of N).
Every draw goes through the prompt stream, so the stream's position covers the extra prompts and a
resumed run draws exactly what the uninterrupted run drew.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from grpo_cli.distributed import SINGLE, World
from grpo_cli.errors import ConfigError
from grpo_cli.records import Rows, first, nested, row, whole
from grpo_cli.rewards import RewardResult
from grpo_cli.rollout import Rollout


@dataclass
class Groups(Rows):
    """Prompts and their G completions each, with the completions' rewards: a generation batch of one rank, or what
    a step trains on. Its rows are the groups: `take(groups)` picks examples[g] with rollout and result rows
    g*G .. g*G+G-1, `cat` joins draws (grpo_cli.records)."""

    examples: list[dict] = row()
    positions: list[int] = row()  # each example's position in the prompt stream (its prompt_id)
    rollout: Rollout = nested("size")  # [B * G rows] grouped by example: rows i*G .. i*G+G-1 answer examples[i]
    result: RewardResult = nested("size")  # [B * G rows], as the rollout's
    size: int = whole(first)  # G, the completions per prompt


def has_signal(scores: list[float | None], group_size: int) -> list[bool]:
    """Per group of `group_size` consecutive scores: whether its scored values are not all equal.

    [N] -> [N / G]. None (no score) and NaN do not count; fewer than 2 scores is no signal.
    """
    out = []
    for g in range(0, len(scores), group_size):
        values = [s for s in scores[g:g + group_size] if s is not None and not math.isnan(s)]
        out.append(len(values) >= 2 and max(values) - min(values) > 1e-8)
    return out


class GroupFilter:
    """`algo.dynamic_sampling` and its two settings (conf/algo/grpo.yaml); see the module docstring."""

    def __init__(self, enabled: bool, filter_metric: str, max_generation_batches: int):
        self.enabled, self.metric, self.max_batches = bool(enabled), filter_metric, int(max_generation_batches)

    def check_metric(self, names: list[str] | None) -> None:
        """Before the model loads: the metric must be one the reward reports (`names`: its functions; None: not
        known until it runs)."""
        if self.enabled and self.metric != "reward" and names is not None and self.metric not in names:
            fit = names[0] if names else "reward"
            raise ConfigError(f"algo.filter_metric ({self.metric}) is not a function of this reward (it has: "
                              f"{', '.join(names) or 'none'}); set algo.filter_metric={fit} (or reward: the sum)")

    def _scores(self, result: RewardResult) -> list[float | None]:
        if self.metric == "reward":
            return result.rewards
        if self.metric not in result.per_function:  # a reward whose functions were not known before it ran
            self.check_metric(list(result.per_function))
        return result.per_function[self.metric]

    def _signal(self, draws: list[Groups], world: World) -> list[list[list[bool]]]:
        """[draw][rank][group]: which groups have signal, every rank's (the same lists on every rank)."""
        mine = [has_signal(self._scores(d.result), d.size) for d in draws]
        ranks = world.gather(mine)  # [rank][draw][group]
        return [[ranks[r][d] for r in range(world.size)] for d in range(len(draws))]

    def done(self, draws: list[Groups], prompts_per_step: int, world: World = SINGLE) -> bool:
        """Whether to stop drawing: one draw when off; else enough groups with signal, or the bound reached."""
        if not draws:
            return False
        if not self.enabled or len(draws) >= self.max_batches:
            return True
        kept = sum(sum(flags) for draw in self._signal(draws, world) for flags in draw)
        return kept >= prompts_per_step

    def state(self, metrics: dict) -> str:
        """What the console says of a step's filter (its `dynamic/...` metrics): nothing when it is off or the batch
        is full; else how many groups varied in how many draws, and what the step trained on."""
        if not metrics.get("dynamic/generation_batches") or metrics["dynamic/batch_full"] == 1.0:
            return ""
        draws, drawn = int(metrics["dynamic/generation_batches"]), metrics["dynamic/prompts_drawn"]
        bound = f"in {draws} draws (algo.max_generation_batches={self.max_batches})"
        if metrics["dynamic/unfiltered"] == 1.0:
            return f"dynamic sampling: every group tied on {self.metric} {bound}; trained on the last draw as it is"
        varied, wanted = round(metrics["dynamic/kept_share"] * drawn), round(drawn / draws)
        return (f"dynamic sampling: {varied} of the {wanted} groups wanted varied on {self.metric} {bound}; trained "
                f"on {int(metrics['dynamic/groups_trained'])}")

    def select(self, draws: list[Groups], prompts_per_step: int, pad: int,
               world: World = SINGLE) -> tuple[Groups, dict[str, float]]:
        """This rank's share of the groups to train on (module docstring), and the filter's metrics (dynamic/...;
        none when it is off)."""
        if not self.enabled:
            return draws[0], {}
        signal = self._signal(draws, world)
        # (draw, rank, group) of every kept group, in the order every rank sees alike
        order = [(d, r, g) for d in range(len(draws)) for r in range(world.size)
                 for g, ok in enumerate(signal[d][r]) if ok]
        generated = sum(len(flags) for draw in signal for flags in draw)
        take = min(prompts_per_step, len(order)) // world.size * world.size
        metrics = {"dynamic/generation_batches": len(draws), "dynamic/prompts_drawn": generated,
                   "dynamic/kept_share": len(order) / max(generated, 1),
                   "dynamic/batch_full": float(take == prompts_per_step), "dynamic/unfiltered": float(take == 0),
                   "dynamic/groups_trained": take}
        if take == 0:  # nothing with signal within the bound: the last draw as it is
            return draws[-1], metrics
        chosen = order[:take]
        # each rank's kept groups as CPU records of one group, gathered so that every rank can take its share
        pieces = {(d, r, g): draws[d].take([g]).to("cpu") for d, r, g in chosen if r == world.rank}
        everyone = {}
        for part in world.gather(pieces) if world.size > 1 else [pieces]:
            everyone.update(part)
        share = take // world.size
        kept = Groups.cat([everyone[key] for key in chosen[world.rank * share:(world.rank + 1) * share]], pad=pad)
        kept = kept.to(draws[0].rollout.completion_ids.device)
        # the failures of every draw on this rank (each group picked above carried its batch's count)
        result = replace(kept.result, failures=sum(d.result.failures for d in draws))
        return replace(kept, result=result), metrics
