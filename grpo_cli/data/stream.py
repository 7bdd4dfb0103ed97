"""The training stream: a seeded, endless, resumable shuffle of a task's train set, and its rank shards."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from grpo_cli.data.task import Example
from grpo_cli.errors import ConfigError, DataError


class PromptStream:
    """The training stream of a task: a seeded shuffle of `dataset`, reshuffled each epoch, endless.

    Position p of the stream is example perm_e[i] with (e, i) = divmod(p, len(dataset)) and perm_e
    a permutation seeded by (seed, e), so the stream is a pure function of (seed, position):
    `state_dict()` is the position, and a resumed run continues exactly. `shard(rank, world_size)`
    views the same stream for one of several data-parallel ranks: every rank advances the same
    global position and keeps its own contiguous slice of each draw.
    """

    def __init__(self, dataset: Sequence[Example], seed: int, position: int = 0) -> None:
        if len(dataset) == 0:
            raise DataError("the training set is empty; check data.path, data.limit and the filters")
        self.dataset = dataset
        self.seed = seed
        self.position = position
        self._perm: tuple[int, Any] | None = None  # (epoch, permutation) of the epoch last read

    def _permutation(self, epoch: int):
        if self._perm is None or self._perm[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._perm = (epoch, torch.randperm(len(self.dataset), generator=generator))
        return self._perm[1]

    def __getitem__(self, position: int) -> Example:
        epoch, i = divmod(position, len(self.dataset))
        return self.dataset[int(self._permutation(epoch)[i])]

    def next(self, k: int) -> list[Example]:
        """The next k examples; the stream moves on by k."""
        out = [self[p] for p in range(self.position, self.position + k)]
        self.position += k
        return out

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position, "seed": self.seed, "size": len(self.dataset)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("seed", self.seed) != self.seed or state.get("size", len(self.dataset)) != len(self.dataset):
            raise ConfigError(f"the saved data stream (seed {state.get('seed')}, {state.get('size')} examples) is not "
                              f"this one (seed {self.seed}, {len(self.dataset)} examples); resume with the run's "
                              f"own data and trainer.seed")
        self.position = int(state["position"])

    def shard(self, rank: int, world_size: int) -> StreamShard:
        return StreamShard(self, rank, world_size)


class StreamShard:
    """Rank `rank` of `world_size`'s view of a PromptStream: `next(k)` draws k examples globally
    (every rank draws the same ones) and returns this rank's k / world_size, a contiguous slice."""

    def __init__(self, stream: PromptStream, rank: int, world_size: int) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank ({rank}) must be in [0, world_size={world_size})")
        self.stream, self.rank, self.world_size = stream, rank, world_size
        self.drawn_from: int | None = None  # the stream position of this rank's first example of the last draw
        self.per_rank = 0  # examples of the last draw on this rank

    def next(self, k: int) -> list[Example]:
        if k % self.world_size:
            fix = k + self.world_size - k % self.world_size
            raise ConfigError(f"trainer.prompts_per_step ({k}) must divide by the number of ranks "
                              f"({self.world_size}); set trainer.prompts_per_step={fix}")
        per_rank = self.per_rank = k // self.world_size
        start = self.drawn_from = self.stream.position + self.rank * per_rank
        out = [self.stream[p] for p in range(start, start + per_rank)]
        self.stream.position += k
        return out

    def peek(self, k: int, skip: int = 0) -> list[Example]:
        """This rank's examples of the draw of k that comes after `skip` more draws of k, the stream unmoved: what
        `next(k)` would return then (rollouts sampled ahead, grpo_cli/rollout/ahead.py)."""
        per_rank = k // self.world_size
        start = self.stream.position + skip * k + self.rank * per_rank
        return [self.stream[p] for p in range(start, start + per_rank)]

    @property
    def positions(self) -> list[int]:
        """The stream positions of this rank's examples of the last draw (their prompt ids)."""
        return list(range(self.drawn_from, self.drawn_from + self.per_rank)) if self.drawn_from is not None else []

    def state_dict(self) -> dict[str, int]:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.stream.load_state_dict(state)

