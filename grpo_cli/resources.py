"""Where the YAML lives: conf/ and recipes/ beside the package in a checkout, inside it in a wheel (a leaf)."""

from __future__ import annotations

from pathlib import Path

_PKG = Path(__file__).resolve().parent


def _resource_dir(name: str) -> Path:
    """conf/ and recipes/ sit beside the package in the source tree and inside it in a wheel."""
    for candidate in (_PKG / name, _PKG.parent / name):
        if candidate.is_dir():
            return candidate
    raise RuntimeError(f"cannot find the {name}/ folder next to {_PKG}; reinstall grpo-cli")


CONF_DIR = _resource_dir("conf")


RECIPES_DIR = _resource_dir("recipes")

