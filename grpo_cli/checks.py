"""The shape of a config check, shared by every module that owns a config section (a leaf).

Each module that owns settings keeps its checks beside its code, as a list `CHECKS`:
  - a `Rule(key, ok, fix)`: the value at a dotted key must pass `ok`; the error line names the key, the
    value and the fix. A key absent from the composed config is skipped (one list serves train, eval and
    sample), so tests/integration/test_cli.py proves every rule's key exists in some composed config;
  - or a function `cfg -> list[str]` for what one value alone cannot say (two settings that must agree).
`config.validate(cfg, *command_checks)` runs every module's list and the command's own, and reports every
problem at once, one line each.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from grpo_cli.errors import ConfigError


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: Any) -> bool:
    """A finite number: YAML and the command line read `inf` and `nan` as floats, and `inf > 0` holds."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def one_of(values: Iterable[str]) -> str:
    """"a, b or c" for an error line."""
    values = list(values)
    return ", ".join(values[:-1]) + " or " + values[-1]


def get(cfg: DictConfig, key: str) -> tuple[bool, Any]:
    """(present, value) of a dotted key; absent anywhere on the path is (False, None)."""
    node: Any = cfg
    for part in key.split("."):
        if not isinstance(node, DictConfig) or part not in node:
            return False, None
        node = node[part]
    return True, node


@dataclass(frozen=True)
class Rule:
    """The value at `key` must satisfy `ok`; otherwise "KEY (VALUE) FIX"."""

    key: str
    ok: Callable[[Any], bool]
    fix: str

    def __call__(self, cfg: DictConfig) -> list[str]:
        present, value = get(cfg, self.key)
        return [f"{self.key} ({value!r}) {self.fix}"] if present and not self.ok(value) else []


Check = Rule | Callable[[DictConfig], list[str]]


def raised(check: Callable[[DictConfig], Any]) -> Callable[[DictConfig], list[str]]:
    """A check from a function that raises ConfigError (one message, maybe several lines) or returns."""
    def run(cfg: DictConfig) -> list[str]:
        try:
            check(cfg)
        except ConfigError as err:
            return str(err).splitlines()
        return []

    run.__name__ = getattr(check, "__name__", "check")
    return run
