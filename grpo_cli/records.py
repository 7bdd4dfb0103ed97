"""Records of rows: one protocol for the records whose fields hold an entry per row (a rollout's completions, a
reward call's scores, a step's groups), so that picking, joining and moving rows is written once.

    part = record.take(rows)             # those rows, in that order: [N, ...] -> [len(rows), ...]
    whole = Kind.cat(parts, pad=pad_id)  # the parts' rows in order (`pad`: what pads token ids, for a Rollout)
    moved = record.to(device)            # every tensor on `device`

A record is a dataclass deriving from `Rows`; each field says once, in its declaration, how it travels:

    row()        an entry per row: a list, or a tensor whose dim 0 is the row ([N, ...]); tensors of different
                 widths join padded on `side` with `pad` (PAD: cat's `pad` option); `absent` says what a part that
                 lacks the field (None) stands in with when another part has it (None: the joined field is None)
    keyed()      a dict of per-row lists (a reward's scores per function): every part's names, in the order first
                 seen; a part without a name gives None on its rows
    whole(join)  one value for all the rows (a batch's failure count, a setting): `take` keeps it, `cat` joins
                 the parts' values with `join` (sum; `first`)
    nested(per)  a record of its own with `per` rows (the field of that name) for each of this record's rows: a
                 group's G completions

A new per-row field is one declaration: take, cat, to, and the cross-rank gathering built on them read it from
there. The ground floor: imports nothing of grpo_cli.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

R = TypeVar("R", bound="Rows")

# a row field's padding value that is cat's `pad` option: the token id that pads prompts and completions
PAD = "pad"
_KIND = "rows"


def row(*, pad: Any = 0, side: str = "right", absent: Callable[[Any], Any] | None = None,
        default: Any = dataclasses.MISSING) -> Any:
    """A field with an entry per row (see the module docstring); `default` as dataclasses.field's."""
    return dataclasses.field(default=default, metadata={_KIND: "row", "pad": pad, "side": side, "absent": absent})


def keyed(default: Any = dataclasses.MISSING) -> Any:
    """A dict of per-row lists."""
    return dataclasses.field(default=default, metadata={_KIND: "keyed"})


def whole(join: Callable[[list], Any], default: Any = dataclasses.MISSING) -> Any:
    """One value for all the rows; `join` makes the joined record's from the parts' values."""
    return dataclasses.field(default=default, metadata={_KIND: "whole", "join": join})


def nested(per: str) -> Any:
    """A record with `getattr(self, per)` rows for each row of this one."""
    return dataclasses.field(metadata={_KIND: "nested", "per": per})


def first(values: list) -> Any:
    """`whole`'s join for a setting every part shares: the first part's."""
    return values[0]


def _pick(value: Any, rows: list[int], index: torch.Tensor) -> Any:
    if value is None:
        return None
    return value[index] if isinstance(value, torch.Tensor) else [value[i] for i in rows]


def _join(values: list, pad: Any, side: str) -> Any:
    """The parts' values of one row field, in order: lists concatenated, tensors padded to the widest (dim 1)."""
    if not isinstance(values[0], torch.Tensor):
        return [v for value in values for v in value]
    if values[0].dim() > 1:
        width = max(v.shape[1] for v in values)
        # [n, w] -> [n, width]: before a left-padded prompt, after a right-padded completion
        values = [torch.nn.functional.pad(v, (width - v.shape[1], 0) if side == "left" else (0, width - v.shape[1]),
                                          value=pad) for v in values]
    return torch.cat(values)


class Rows:
    """The protocol's three operations, read from the fields' declarations (module docstring)."""

    def take(self: R, rows: Sequence[int] | torch.Tensor) -> R:
        """The rows `rows`, in that order; `whole` fields as they are."""
        index = torch.as_tensor(rows, dtype=torch.long)
        pick = index.tolist()
        out = {}
        for f in dataclasses.fields(self):
            value, kind = getattr(self, f.name), f.metadata.get(_KIND)
            if kind == "row":
                out[f.name] = _pick(value, pick, index)
            elif kind == "keyed":
                out[f.name] = {k: _pick(v, pick, index) for k, v in value.items()}
            elif kind == "nested":
                per = getattr(self, f.metadata["per"])
                out[f.name] = value.take([r * per + j for r in pick for j in range(per)])
            else:
                out[f.name] = value
        return dataclasses.replace(self, **out)

    @classmethod
    def cat(cls: type[R], parts: Sequence[R], **options: Any) -> R:
        """The parts' rows in order; one part is itself. `options`: `pad` (PAD), handed on to nested records."""
        if not parts:
            raise ValueError(f"{cls.__name__}.cat needs at least one part")
        if len(parts) == 1:
            return parts[0]
        out = {}
        for f in dataclasses.fields(cls):
            values, kind = [getattr(p, f.name) for p in parts], f.metadata.get(_KIND)
            if kind == "row":
                out[f.name] = _join_rows(parts, values, f.metadata, options)
            elif kind == "keyed":
                names = list(dict.fromkeys(k for v in values for k in v))
                out[f.name] = {k: [x for p, v in zip(parts, values) for x in v.get(k, [None] * p.count())]
                               for k in names}
            elif kind == "nested":
                out[f.name] = type(values[0]).cat(values, **options)
            elif kind == "whole":
                out[f.name] = f.metadata["join"](values)
            else:
                raise TypeError(f"{cls.__name__}.{f.name} is declared with none of row, keyed, whole, nested")
        return cls(**out)

    def to(self: R, device: torch.device | str) -> R:
        """The same rows with every tensor on `device`."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                out[f.name] = value.to(device)
            elif f.metadata.get(_KIND) == "nested":
                out[f.name] = value.to(device)
        return dataclasses.replace(self, **out)

    def count(self) -> int:
        """How many rows: the length of the first row field that is set."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.metadata.get(_KIND) == "row" and value is not None:
                return len(value)
        raise ValueError(f"{type(self).__name__} has no row field set")


def _join_rows(parts: Sequence[Rows], values: list, meta: dict, options: dict) -> Any:
    """One row field of the parts, joined: None where every part lacks it (or one does, without `absent`)."""
    if all(v is None for v in values):
        return None
    if any(v is None for v in values):
        if meta["absent"] is None:
            return None
        values = [meta["absent"](p) if v is None else v for p, v in zip(parts, values)]
    pad = options.get("pad") if meta["pad"] == PAD else meta["pad"]
    return _join(values, pad, meta["side"])
