"""data.PromptStream on its own: seeded epochs, exact resume, disjoint shards that cover the stream."""

from __future__ import annotations

import pytest

from grpo_cli.data import PromptStream
from grpo_cli.errors import ConfigError, DataError

DATA = [{"question": f"q{i}"} for i in range(10)]


def questions(examples):
    return [e["question"] for e in examples]


def test_each_epoch_is_a_permutation_and_epochs_differ():
    stream = PromptStream(DATA, seed=3)
    first, second = questions(stream.next(10)), questions(stream.next(10))
    assert sorted(first) == sorted(second) == sorted(questions(DATA))  # every example once per epoch
    assert first != second  # reshuffled: 10! orders, the two seeded ones differ
    assert first != questions(DATA)  # shuffled at all
    assert questions(PromptStream(DATA, seed=3).next(20)) == first + second  # a function of (seed, position)
    assert questions(PromptStream(DATA, seed=4).next(10)) != first


def test_draws_cross_epoch_boundaries_seamlessly():
    whole = questions(PromptStream(DATA, seed=0).next(25))
    stream = PromptStream(DATA, seed=0)
    pieces = [questions(stream.next(k)) for k in (3, 4, 7, 11)]  # 3+4+7+11 = 25, two boundaries crossed
    assert sum(pieces, []) == whole
    assert stream.position == 25


def test_resume_continues_where_the_state_was_saved():
    stream = PromptStream(DATA, seed=1)
    stream.next(7)
    state = stream.state_dict()
    assert state == {"position": 7, "seed": 1, "size": 10}
    rest = questions(stream.next(8))
    resumed = PromptStream(DATA, seed=1)
    resumed.load_state_dict(state)
    assert questions(resumed.next(8)) == rest


def test_a_state_from_another_stream_is_refused():
    with pytest.raises(ConfigError, match="trainer.seed"):
        PromptStream(DATA, seed=1).load_state_dict({"position": 3, "seed": 2, "size": 10})
    with pytest.raises(ConfigError, match="11 examples"):
        PromptStream(DATA, seed=1).load_state_dict({"position": 3, "seed": 1, "size": 11})


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_shards_are_disjoint_and_cover_the_global_draw(world_size):
    k = 4  # prompts per step, divisible by every world size here
    reference = PromptStream(DATA, seed=5)
    shards = [PromptStream(DATA, seed=5).shard(rank, world_size) for rank in range(world_size)]
    for _ in range(6):  # 24 draws: crosses two epochs
        whole = questions(reference.next(k))
        parts = [questions(shard.next(k)) for shard in shards]
        assert all(len(p) == k // world_size for p in parts)
        assert sum(parts, []) == whole  # rank r holds the r-th contiguous slice: disjoint, covering, in order
    assert {s.state_dict()["position"] for s in shards} == {24}  # every rank at the same global position


def test_shard_needs_a_divisible_draw_and_a_valid_rank():
    with pytest.raises(ConfigError, match="prompts_per_step=4"):
        PromptStream(DATA, seed=0).shard(0, 2).next(3)
    with pytest.raises(ValueError):
        PromptStream(DATA, seed=0).shard(2, 2)


def test_an_empty_dataset_is_an_error():
    with pytest.raises(DataError, match="empty"):
        PromptStream([], seed=0)
