"""Rows without prompts, for an environment class that writes each prompt itself (`data=env`; TRL's
environment-owned data, docs/environments.md).

    grpo train data=env env=class env.factory=my_env.Game                    # 1000 rows {"seed": i}, no file
    grpo train data=env data.path=games/ env=class env.factory=my_env.Game   # a file's rows: train.jsonl, test.jsonl

A row is what `reset(**row)` receives: `{"seed": i}` when the rows are generated (data.path null), or a file's JSON
object, any columns but a prompt. Every episode of a group gets the same row, so a `reset` that draws its game from
the row (its seed) gives the group one game to compare answers on. An example is

    {"messages": [system turn?, {"role": "user", "content": ""}],  # the user turn: what reset returns fills it
     "question": '{"seed": 7}',                                    # the row as JSON, where logs and rewards show text
     "prompt": None,                                               # no prompt as the data gives it: the environment's
     **row}

`prompt: None` is how the episode runner (grpo_cli.env.prepare) knows the row has no prompt of its own: it keeps
`prompt` out of `reset`'s keywords and puts what `reset` returns in the empty user turn (a string), or in its place
(a list of messages). Rows are not compared across splits: the model sees only what the environment writes, so a
held-out row may equal a training row (a game with 15 secrets repeats them in every split).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any

from grpo_cli.data.files import read_local
from grpo_cli.data.hf import RESERVED
from grpo_cli.data.task import AUTO_MOST, AUTO_SHARE, Example, _check_int, _Generated, _Task
from grpo_cli.errors import DataError


class EnvTask(_Task):
    """Generated seeds or a file's rows, each example an empty user turn for the environment; see the module
    docstring."""

    def __init__(self, *, path: str | None, size: int, heldout_size: int | str, seed: int,
                 system_prompt: str | None, chat_template: str | None = None,
                 chat_template_kwargs: dict | None = None) -> None:
        super().__init__(seed=seed, heldout_size=heldout_size, system_prompt=system_prompt, instruction="{question}",
                         few_shot=0, chat_template=chat_template, chat_template_kwargs=chat_template_kwargs)
        if path is None:
            _check_int("size", size, 1, 1000)
            # auto: a tenth of the training rows, at least 1, at most AUTO_MOST, as a file's slice; here they come on
            # top of the training rows: seeds 0 .. size - 1 to train on, the next `held` held out
            held = max(1, min(AUTO_MOST, size // AUTO_SHARE)) if heldout_size == "auto" else heldout_size
            self.source = f"{size} generated rows"
            self.train: Sequence[Example] = _Generated(size, lambda i: self._row({"seed": i}))
            self.heldout: Sequence[Example] = _Generated(held, lambda i: self._row({"seed": size + i}))
            return
        train, test, self.source = read_local(str(path), "train")
        if not train:
            raise DataError(f"{self.source} holds no rows (an empty file, or blank lines only); set data.path=... to "
                            f"a file with one JSON object per line, each a row for reset(**row)")
        rows = [self._checked(where, record) for where, record in train]
        if test is None:
            order = list(range(len(rows)))
            random.Random(seed).shuffle(order)
            count = self._heldout_count(len(rows), len(rows), self.source)
            held_ids = set(order[:count])
            if len(held_ids) >= len(rows):
                raise DataError(f"{self.source} has no training rows left after holding out {count} of its "
                                f"{len(rows)}; set data.heldout_size={len(rows) - 1} or lower, or give the folder a "
                                f"test.jsonl")
            held = [rows[i] for i in sorted(held_ids)]
            rows = [r for i, r in enumerate(rows) if i not in held_ids]
        else:
            held = [self._checked(where, record) for where, record in test]
        self.train = [self._row(r) for r in rows]
        self.heldout = [self._row(r) for r in held]

    def _checked(self, where: str, record: dict) -> dict:
        """A file's row, or a DataError naming it when a column has a name the examples use (a prompt among them)."""
        clash = [c for c in record if c in RESERVED]
        if clash:
            raise DataError(f"{where}: column {clash[0]!r} has a name grpo uses for the prompt or the reward call "
                            f"({', '.join(RESERVED)}); with data=env the environment writes the prompt, so rename "
                            f"it (or use data=hf for rows that bring their own prompt)")
        return record

    def _row(self, row: dict[str, Any]) -> Example:
        return {"messages": self._messages(""), "question": json.dumps(row, sort_keys=True, default=str),
                "prompt": None, **row}

    def __repr__(self) -> str:
        return f"EnvTask({self.source}, train={len(self.train)}, heldout={len(self.heldout)})"
