"""The trainer's state: what a training step advances and a checkpoint keeps (checkpoints/step_N/trainer_state.json).

    state = TrainerState(step=0, history=[], dtype="float32")   # recipe.setup
    checkpoint.save(..., state.to_json(), ...)                  # the file's object, key for key
    state = TrainerState.from_json(json.loads(text))            # from any grpo-cli's checkpoint

One typed record, written by the modules that own each part: the step, its history, the prompt stream's position,
the data-parallel world (recipe.step), the RNG and the rollouts in flight (recipe.save), the folder the run started
in (commands/train.py), the guard's decisions (guard.apply), iterative RL's boundaries (the reward schedule). A part
with nothing to hold is left out of the file (None here), as grpo train has always written it, so a checkpoint from
before a key existed reads back with that key None and is written back as it was. json_shapes.SHAPES checks a file's
shape before it is read.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class TrainerState:
    """trainer_state.json's keys, in the order grpo train writes them."""

    step: int                      # optimizer steps taken
    history: list[dict]            # each step's metrics.jsonl record, without its time/ keys (the guard reads them)
    dtype: str | None = None       # the precision the base weights ran in (export.dtype=auto writes it)
    started_in: str | None = None  # the folder the run started in: its relative paths are read from there (runs)
    iterative: dict | None = None  # iterative RL's boundaries so far (iterative.IterativeRL.state_dict)
    world_size: int | None = None  # the ranks that saved it
    data: dict | None = None       # the prompt stream's position (data.PromptStream.state_dict)
    rng: dict | None = None        # {"torch": torch's RNG state as bytes}: dropout's draws go on from there
    ahead: dict | None = None      # the rollouts in flight (algo.max_staleness > 0, rollout.ahead.Ahead.state_dict)
    guard: dict | None = None      # the guard's decisions so far (guard.GuardState); none before the first

    def to_json(self) -> dict:
        """The file's object: every part that holds something, in field order."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}

    def load(self, saved: dict) -> None:
        """A checkpoint's parts (a file's object) in place of these, on resume: a part the file lacks (saved before
        it existed) stays as it is, and dtype stays this machine's (model.dtype=auto resolves here)."""
        for key, value in dataclasses.asdict(TrainerState.from_json(saved)).items():
            if value is not None and key != "dtype":
                setattr(self, key, value)

    @classmethod
    def from_json(cls, state: dict) -> TrainerState:
        """A file's object (its shape checked by json_shapes); a key it lacks is None."""
        return cls(**{f.name: state[f.name] for f in dataclasses.fields(cls) if f.name in state})
