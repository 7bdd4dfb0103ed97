"""grpo_cli/records.py: one protocol (take, cat, to) read from the fields' declarations, shared by Rollout,
RewardResult and the step's Groups; and the cross-rank gathering of a step's metrics built on it (2 gloo ranks)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from grpo_cli.env import Episode
from grpo_cli.groups import Groups
from grpo_cli.records import PAD, Rows, first, keyed, row, whole
from grpo_cli.rewards import RewardResult
from grpo_cli.rollout import Rollout
from tests.helpers.ranks import gloo_rank, two_ranks


@dataclass
class Batch(Rows):
    """A record of every kind of field, as a new record would declare them."""

    ids: torch.Tensor = row(pad=PAD, side="left")  # [N, W] left-padded with cat's pad
    names: list[str] = row()
    scores: dict[str, list] = keyed()
    failures: int = whole(sum)
    setting: str = whole(first)
    extra: list | None = row(absent=lambda part: ["-"] * len(part.names), default=None)  # a field added later


def test_a_field_declared_once_is_taken_joined_and_moved():
    a = Batch(torch.tensor([[1, 2], [3, 4]]), ["a0", "a1"], {"x": [1, 2]}, 1, "s", ["e0", "e1"])
    b = Batch(torch.tensor([[5, 6, 7]]), ["b0"], {"y": [9]}, 2, "t")
    both = Batch.cat([a, b], pad=-1)
    assert both.ids.tolist() == [[-1, 1, 2], [-1, 3, 4], [5, 6, 7]]  # [3, 3]: the narrower part padded on the left
    assert both.names == ["a0", "a1", "b0"] and both.extra == ["e0", "e1", "-"]  # b lacks extra: its stand-in
    assert both.scores == {"x": [1, 2, None], "y": [None, None, 9]}  # every part's names; None where a part has none
    assert (both.failures, both.setting) == (3, "s")  # summed; the first part's
    picked = both.take([2, 0])
    assert picked.ids.tolist() == [[5, 6, 7], [-1, 1, 2]] and picked.names == ["b0", "a0"]
    assert picked.scores == {"x": [None, 1], "y": [9, None]} and picked.failures == 3 and picked.extra == ["-", "e0"]
    assert Batch.cat([a]) is a  # one part is itself
    assert Batch.cat([b, b]).extra is None  # no part has it
    moved = a.to("meta")
    assert moved.ids.device.type == "meta" and moved.names is a.names
    with pytest.raises(ValueError, match="needs at least one part"):
        Batch.cat([])


def test_rollouts_join_as_the_engine_pads_them():
    ones = torch.ones(1, 1, dtype=torch.long)
    plain = Rollout(torch.tensor([[7]]), ones, torch.tensor([[8, 9]]), torch.tensor([[1, 1]]), ["p"], [False],
                    sampling_logp=torch.tensor([[-1.0, -2.0]]))
    episode = Rollout(torch.tensor([[5, 6]]), torch.tensor([[1, 1]]), torch.tensor([[4]]), ones, ["e"], [True],
                      sampled_mask=ones, episodes=["ep"])
    both = Rollout.cat([plain, episode], pad=0)
    assert both.prompt_ids.tolist() == [[0, 7], [5, 6]] and both.prompt_mask.tolist() == [[0, 1], [1, 1]]  # left
    assert both.completion_ids.tolist() == [[8, 9], [4, 0]] and both.completion_mask.tolist() == [[1, 1], [1, 0]]
    # a plain part's ids were all sampled; its episode is None; a part without the engine's log-probs: none kept
    assert both.sampled_mask.tolist() == [[1, 1], [1, 0]] and both.episodes == [None, "ep"]
    assert both.sampling_logp is None and both.lengths == [2, 1] and both.truncated == [False, True]


def test_reward_results_keep_a_batchs_failures_and_join_per_turn_rewards():
    turns = RewardResult([1.0, 2.0], {"f": [1.0, 2.0]}, failures=1, turns=[[0.5, 0.5], [2.0]])
    episodes = RewardResult([3.0, None], {"f": [3.0, None]}, failures=2)
    both = RewardResult.cat([turns, episodes])
    # a part scored per episode: each reward is its episode's last turn's; None: no scored turn
    assert both.turns == [[0.5, 0.5], [2.0], [3.0], []] and both.failures == 3
    assert both.take([3, 0]).rewards == [None, 1.0] and both.take([3, 0]).failures == 3


def test_groups_take_each_groups_g_rows():
    n, G = 6, 2
    ones = torch.ones(n, 1, dtype=torch.long)
    rollout = Rollout(ones, ones, torch.arange(n).view(n, 1), ones, [str(i) for i in range(n)], [False] * n)
    groups = Groups([{"q": 0}, {"q": 1}, {"q": 2}], [10, 11, 12], rollout,
                    RewardResult([float(i) for i in range(n)], {}), G)
    picked = groups.take([2, 0])
    assert picked.examples == [{"q": 2}, {"q": 0}] and picked.positions == [12, 10] and picked.size == G
    assert picked.rollout.texts == ["4", "5", "0", "1"] and picked.result.rewards == [4.0, 5.0, 0.0, 1.0]
    assert Groups.cat([picked, groups.take([1])], pad=0).rollout.texts == ["4", "5", "0", "1", "2", "3"]


# ---- 2 ranks: the step's metrics over every rank's completions --------------------------------------------

def _episode(calls: int, sampled: list[int], turns: int) -> Episode:
    e = Episode([1], toolbox=lambda: None)  # a lambda does not pickle, as an env=class instance need not
    e.tool_calls, e.sampled, e.turn_ends = calls, sampled, list(range(turns))
    return e


def _metrics_worker(rank: int, size: int, init_method: str, out: str) -> None:
    from grpo_cli import recipe
    from grpo_cli.metrics.stats import rollout_metrics

    with gloo_rank(rank, size, init_method) as world:
        n = 2
        mask = torch.tensor([[1, 1, 1], [1, 0, 0]]) if rank == 0 else torch.tensor([[1, 1, 0], [1, 1, 1]])
        ones = torch.ones(n, 1, dtype=torch.long)
        rollout = Rollout(ones, ones, mask, mask, ["a", "b"], [False, rank == 1], sampled_mask=torch.ones(n, 3),
                          episodes=[_episode(rank + 1, [1, 0], 1), _episode(0, [1, 1], 2)])
        names = {"f": [1.0, 0.0]} if rank == 0 else {"f": [0.0, 0.0], "g": [1.0, 1.0]}
        result = RewardResult([1.0 + rank, 0.0], names, failures=rank + 1)
        kept = Groups([{}], [rank], rollout, result, n)
        metrics = rollout_metrics(*recipe._everyone(world, kept), kept.size)
        Path(out, f"rank{rank}.json").write_text(json.dumps(metrics))


@pytest.mark.slow  # 2 rank processes (the fork server starts for it alone: ~9 s): make test-ci
@pytest.mark.ci
def test_two_ranks_metrics_count_every_ranks_completions(tmp_path):
    two_ranks(_metrics_worker, tmp_path)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0 == r1
    # rewards 1, 0 | 2, 0; failures 1 + 2; lengths 3, 1 | 2, 3; truncated 0, 0 | 1, 0
    assert r0["reward"] == 0.75 and r0["reward_failures"] == 3 and r0["completions/clipped_ratio"] == 0.25
    assert r0["completions/mean_length"] == 9 / 4 and r0["completions/max_length"] == 3
    # "g" only on rank 1: rank 0's rows have no score from it
    assert r0["rewards/f/mean"] == 0.25 and r0["rewards/g/no_score"] == 2
    # episodes' counts from both ranks: tool calls 1 + 0 + 2 + 0 of 4 episodes, turns 1, 2, 1, 2
    assert r0["tools/call_frequency"] == 0.75 and r0["turns/mean"] == 1.5
