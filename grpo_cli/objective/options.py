"""`choose`: a setting's name -> what it names (a function, a record), and the one check of a name in this
package: an unknown name (loss_type, kl_estimator, ...) fails here, naming the allowed values."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

Option = TypeVar("Option")


def choose(setting: str, name: str, options: Mapping[str, Option]) -> Option:
    """options[name]; an unknown name is a ValueError naming the setting and the allowed names.

    The config's names were checked before the model loaded (grpo_cli.algo); this is for a caller of the
    functions themselves.
    """
    if name not in options:
        raise ValueError(f"{setting} ({name!r}) must be one of {tuple(options)}")
    return options[name]
