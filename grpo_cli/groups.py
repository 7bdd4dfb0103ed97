"""Which sampled groups a step trains on: all of them, or (dynamic sampling) only those with signal.

    keep = GroupFilter(enabled, filter_metric, max_generation_batches)
    draws = []
    while not keep.done(draws, prompts_per_step, world):          # the trainer's steps 1-3, repeated
        draws.append(Draw(examples, positions, rollout, result))  # prompts -> G completions -> rewards
    kept = keep.select(draws, prompts_per_step, group_size, pad, world)

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
from grpo_cli.rewards import RewardResult
from grpo_cli.rollout import Rollout


@dataclass
class Draw:
    """One generation batch of one rank: its prompts, their G completions each, and their rewards."""

    examples: list[dict]
    positions: list[int]  # each example's position in the prompt stream (its prompt_id)
    rollout: Rollout  # rows grouped by example: rows i*G .. i*G+G-1 answer examples[i]
    result: RewardResult


@dataclass
class Kept:
    """What the step trains on (this rank's share) and how the filter got there."""

    examples: list[dict]
    positions: list[int]
    rollout: Rollout
    result: RewardResult
    metrics: dict[str, float]  # dynamic/...; empty when the filter is off


def has_signal(scores: list[float | None], group_size: int) -> list[bool]:
    """Per group of `group_size` consecutive scores: whether its scored values are not all equal.

    [N] -> [N / G]. None (no score) and NaN do not count; fewer than 2 scores is no signal.
    """
    out = []
    for g in range(0, len(scores), group_size):
        values = [s for s in scores[g:g + group_size] if s is not None and not math.isnan(s)]
        out.append(len(values) >= 2 and max(values) - min(values) > 1e-8)
    return out


def select_result(result: RewardResult, rows: list[int]) -> RewardResult:
    """The rows `rows` of a reward result (failures are the batch's and stay with it)."""
    def pick(values: list | None) -> list | None:
        return None if values is None else [values[i] for i in rows]

    # every per-completion field picked, the rest (failures, process_weight) kept as they are
    return replace(result, rewards=pick(result.rewards), steps=pick(result.steps), turns=pick(result.turns),
                   outcome=pick(result.outcome), per_function={k: pick(v) for k, v in result.per_function.items()})


def concat_results(parts: list[RewardResult]) -> RewardResult:
    names = list(parts[0].per_function) if parts else []
    return RewardResult(rewards=[r for p in parts for r in p.rewards],
                        per_function={k: [v for p in parts for v in p.per_function[k]] for k in names},
                        failures=sum(p.failures for p in parts),
                        steps=None if not parts or parts[0].steps is None else [s for p in parts for s in p.steps],
                        outcome=None if not parts or parts[0].outcome is None else [
                            o for p in parts for o in p.outcome],
                        process_weight=parts[0].process_weight if parts else None,
                        turns=_turns(parts),
                        credit=parts[0].credit if parts else "sum")


def _turns(parts: list[RewardResult]) -> list[list[float | None]] | None:
    """The per-turn rewards of the parts' rows; a part scored per episode gives each its reward as its last turn's
    (`credit.token_rewards` aligns a short row with the episode's last turns). None when no part is per-turn."""
    if all(p.turns is None for p in parts):
        return None
    return [t for p in parts for t in (p.turns or [[] if r is None else [r] for r in p.rewards])]


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

    def _signal(self, draws: list[Draw], group_size: int, world: World) -> list[list[list[bool]]]:
        """[draw][rank][group]: which groups have signal, every rank's (the same lists on every rank)."""
        mine = [has_signal(self._scores(d.result), group_size) for d in draws]
        ranks = world.gather(mine)  # [rank][draw][group]
        return [[ranks[r][d] for r in range(world.size)] for d in range(len(draws))]

    def done(self, draws: list[Draw], prompts_per_step: int, group_size: int, world: World = SINGLE) -> bool:
        """Whether to stop drawing: one draw when off; else enough groups with signal, or the bound reached."""
        if not draws:
            return False
        if not self.enabled or len(draws) >= self.max_batches:
            return True
        kept = sum(sum(flags) for draw in self._signal(draws, group_size, world) for flags in draw)
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

    def select(self, draws: list[Draw], prompts_per_step: int, group_size: int, pad: int,
               world: World = SINGLE) -> Kept:
        """This rank's share of the groups to train on (module docstring), with the filter's metrics."""
        if not self.enabled:
            d = draws[0]
            return Kept(d.examples, d.positions, d.rollout, d.result, {})
        signal = self._signal(draws, group_size, world)
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
            d = draws[-1]
            return Kept(d.examples, d.positions, d.rollout, d.result, metrics)
        chosen = order[:take]
        # each rank's kept groups as plain CPU pieces, gathered so that every rank can take its share
        pieces = {}
        for d, r, g in chosen:
            if r == world.rank:
                draw, rows = draws[d], list(range(g * group_size, (g + 1) * group_size))
                part = draw.rollout.select(rows)
                pieces[(d, r, g)] = (draw.examples[g], draw.positions[g], part.to("cpu"),
                                     select_result(draw.result, rows))
        everyone = {}
        for part in world.gather(pieces) if world.size > 1 else [pieces]:
            everyone.update(part)
        share = take // world.size
        mine = [everyone[key] for key in chosen[world.rank * share:(world.rank + 1) * share]]
        device = draws[0].rollout.completion_ids.device
        rollout = Rollout.concat([m[2] for m in mine], pad).to(device)
        result = concat_results([m[3] for m in mine])
        # the failures of every draw on this rank (the per-row selection above repeated each batch's count)
        result.failures = sum(d.result.failures for d in draws)
        return Kept([m[0] for m in mine], [m[1] for m in mine], rollout, result, metrics)
