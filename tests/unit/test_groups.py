"""Dynamic sampling (grpo_cli.groups, #24): which groups a step trains on, by hand and on 2 gloo ranks
(tests/integration/test_dynamic_sampling.py runs it through `grpo train`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from grpo_cli.errors import ConfigError
from grpo_cli.groups import GroupFilter, Groups, has_signal
from grpo_cli.rewards import RewardResult
from grpo_cli.rollout import Rollout
from tests.helpers.ranks import gloo_rank, two_ranks

G = 2


def _draw(first: int, scores: list[float | None], tag: str = "") -> Groups:
    """A draw of len(scores) // G groups; group i is example `first + i`, its rows' completion ids carry the id."""
    n = len(scores)
    groups = n // G
    ids = torch.tensor([[first + row // G, 7] for row in range(n)])
    texts = [f"{tag}{first + row // G}" for row in range(n)]
    ones = torch.ones(n, 3, dtype=torch.long)
    rollout = Rollout(ones, ones, ids, torch.ones(n, 2, dtype=torch.long), texts, [False] * n)
    result = RewardResult(rewards=[0.0 if s is None else s + 10 for s in scores], per_function={"accuracy": scores},
                          failures=1)
    return Groups([{"question": f"q{first + g}"} for g in range(groups)], list(range(first, first + groups)), rollout,
                  result, G)


def test_has_signal_by_hand():
    # groups of 2: (1, 0) varies; (1, 1) ties; (None, 1) has one score; (nan, 0) one score; (0.5, 0.5 + 1e-12) ties
    assert has_signal([1.0, 0.0, 1.0, 1.0, None, 1.0, float("nan"), 0.0, 0.5, 0.5 + 1e-12], 2) == \
        [True, False, False, False, False]


def test_off_keeps_the_one_draw_as_it_is():
    keep = GroupFilter(False, "accuracy", 3)
    draw = _draw(0, [1.0, 1.0, 0.0, 1.0])
    assert not keep.done([], 2) and keep.done([draw], 2)
    kept, metrics = keep.select([draw], 2, 0)
    assert kept.rollout is draw.rollout and metrics == {}


def test_draws_until_the_batch_is_full_and_keeps_the_first_groups_with_signal():
    keep = GroupFilter(True, "accuracy", 5)
    first = _draw(0, [1.0, 1.0, 0.0, 1.0, 0.0, 0.0])      # groups 0 (tie), 1 (signal), 2 (tie)
    second = _draw(3, [0.0, 1.0, 1.0, 1.0, 1.0, 0.0])     # groups 3 (signal), 4 (tie), 5 (signal)
    assert not keep.done([first], 2)                       # 1 kept of 2 wanted
    assert keep.done([first, second], 2)                   # 3 kept
    kept, metrics = keep.select([first, second], 2, 0)
    # the first 2 groups with signal in draw order: 1, then 3; group 5 is left out
    assert kept.positions == [1, 3] and [e["question"] for e in kept.examples] == ["q1", "q3"]
    assert kept.rollout.completion_ids[:, 0].tolist() == [1, 1, 3, 3]
    assert kept.result.per_function["accuracy"] == [0.0, 1.0, 0.0, 1.0]
    assert kept.result.rewards == [10.0, 11.0, 10.0, 11.0] and kept.result.failures == 2  # one per draw
    # 3 of the 6 groups drawn had signal; 2 draws; full: the 2 wanted trained
    assert kept.size == G and metrics == {"dynamic/generation_batches": 2, "dynamic/prompts_drawn": 6,
                                          "dynamic/kept_share": 0.5, "dynamic/batch_full": 1.0,
                                          "dynamic/unfiltered": 0.0, "dynamic/groups_trained": 2}


def test_the_bound_trains_on_what_was_kept_or_on_the_last_draw_when_nothing_was():
    keep = GroupFilter(True, "accuracy", 2)
    ties = [_draw(0, [1.0, 1.0, 0.0, 0.0]), _draw(2, [0.0, 0.0, 1.0, 1.0])]
    assert keep.done(ties, 2)  # the bound: 2 draws
    kept, metrics = keep.select(ties, 2, 0)
    assert kept.positions == [2, 3] and metrics["dynamic/unfiltered"] == 1.0  # the last draw as it is
    one, metrics = keep.select([ties[0], _draw(2, [0.0, 1.0, 1.0, 1.0])], 2, 0)
    assert one.positions == [2] and metrics["dynamic/batch_full"] == 0.0 and metrics["dynamic/unfiltered"] == 0
    # the sum of the rewards as the metric: here the same ties
    assert GroupFilter(True, "reward", 2).select(ties, 2, 0)[1]["dynamic/unfiltered"] == 1.0


def test_a_metric_the_reward_does_not_report_is_named():
    with pytest.raises(ConfigError, match=r"algo.filter_metric \(acc\) is not a function of this reward \(it has: "
                                          r"accuracy, format\); set algo.filter_metric=accuracy"):
        GroupFilter(True, "acc", 3).check_metric(["accuracy", "format"])
    GroupFilter(False, "acc", 3).check_metric(["accuracy"])  # off: not read
    GroupFilter(True, "acc", 3).check_metric(None)  # not known before the reward runs: checked when it has
    with pytest.raises(ConfigError, match="filter_metric"):
        GroupFilter(True, "acc", 3).done([_draw(0, [1.0, 0.0])], 1)


# ---- 2 ranks ---------------------------------------------------------------------------------------------

# per rank, per draw: the accuracy of its 2 groups of G = 2 (4 prompts a draw, 2 on each rank)
RANK_SCORES = {0: [[1.0, 1.0, 0.0, 1.0], [0.0, 1.0, 1.0, 0.0]],   # draw 0: group 0 tie, 1 signal; draw 1: both
               1: [[0.0, 0.0, 1.0, 1.0], [1.0, 0.0, 1.0, 1.0]]}   # draw 0: ties; draw 1: group 0 signal


def _rank_worker(rank: int, size: int, init_method: str, out: str) -> None:
    with gloo_rank(rank, size, init_method) as world:
        keep = GroupFilter(True, "accuracy", 3)
        # the stream's positions: draw d holds prompts 4d..4d+3, rank r the 2 from 4d + 2r
        draws = [_draw(4 * d + 2 * rank, RANK_SCORES[rank][d], tag=f"r{rank}:") for d in range(2)]
        done = [keep.done(draws[:k], 4, world) for k in (1, 2)]
        kept, metrics = keep.select(draws, 4, 0, world)
        Path(out, f"rank{rank}.json").write_text(json.dumps(
            {"done": done, "positions": kept.positions, "texts": kept.rollout.texts, "metrics": metrics,
             "accuracy": kept.result.per_function["accuracy"]}))


@pytest.mark.slow  # 2 rank processes (the fork server starts for it alone: ~9 s): make test-ci
@pytest.mark.ci
def test_two_ranks_agree_on_what_is_kept_and_take_equal_shares(tmp_path):
    two_ranks(_rank_worker, tmp_path)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    # draw 0 keeps 1 group (rank 0's prompt 1) of the 4 wanted: draw again; draw 1 brings the total to 4
    assert r0["done"] == r1["done"] == [False, True]
    # in (draw, rank, group) order the kept groups are prompts 1, 4, 5, 6; each rank trains on 2 of them, in
    # order, whichever rank sampled them: rank 0 takes 1 and 4, rank 1 takes 5 (rank 0's) and 6 (its own)
    assert (r0["positions"], r1["positions"]) == ([1, 4], [5, 6])
    assert r1["texts"] == ["r0:5", "r0:5", "r1:6", "r1:6"]  # rank 0's completions reached rank 1
    assert r1["accuracy"] == [1.0, 0.0, 1.0, 0.0]
    assert r0["metrics"] == r1["metrics"] and r0["metrics"]["dynamic/kept_share"] == 4 / 8


def test_the_state_is_said_when_the_batch_is_not_full_or_every_group_tied():
    keep = GroupFilter(True, "accuracy", 2)
    # 2 draws of 2 groups each, every group tied: the step trains on the last draw as it is
    _, tied = keep.select([_draw(0, [1.0, 1.0, 0.0, 0.0]), _draw(2, [1.0, 1.0, 1.0, 1.0])], 2, 0)
    assert keep.state(tied) == ("dynamic sampling: every group tied on accuracy in 2 draws "
                                        "(algo.max_generation_batches=2); trained on the last draw as it is")
    # 1 group of the 2 wanted varied (group 1 of the first draw)
    _, short = keep.select([_draw(0, [1.0, 1.0, 0.0, 1.0]), _draw(2, [0.0, 0.0, 1.0, 1.0])], 2, 0)
    assert keep.state(short) == ("dynamic sampling: 1 of the 2 groups wanted varied on accuracy in 2 draws "
                                         "(algo.max_generation_batches=2); trained on 1")
    _, full = keep.select([_draw(0, [1.0, 0.0, 0.0, 1.0])], 2, 0)
    assert keep.state(full) == ""  # a full batch: nothing to say
    off = GroupFilter(False, "accuracy", 2)
    assert off.state(off.select([_draw(0, [1.0, 1.0, 1.0, 1.0])], 2, 0)[1]) == ""
