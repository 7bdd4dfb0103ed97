"""conf/'s group options read as plain data: which option a run's saved section was composed from.

A saved config.yaml holds each group's section, not the option that wrote it (`sampler=vllm_short` saves a sampler
section). `option_of(group, section)` names it again: of the group's options with the section's `_target_`, the one
whose values it shares the most. `option(group, name)` is conf/GROUP/NAME.yaml merged over the options its defaults
list names, as Hydra merges them (tests/unit/test_runs.py holds it to Hydra's own composition). runs.upgrade fills a
run's missing keys from these options, composed.
"""

from __future__ import annotations

import functools
from pathlib import Path

import yaml
from omegaconf._utils import get_yaml_loader  # OmegaConf's YAML rules, for conf/ read without building a config

from grpo_cli.resources import CONF_DIR

TRAIN_YAML = CONF_DIR / "train.yaml"


class _ConfLoader(yaml.CSafeLoader):
    """YAML's C parser (a tenth of the time of the pure-Python one OmegaConf.load runs: `runs.upgrade reads conf/'s ~40
    files in every command that reads a run) with OmegaConf's rules for plain values (`3e-4` is a float)."""

    yaml_implicit_resolvers = get_yaml_loader().yaml_implicit_resolvers


@functools.cache
def read_yaml(path: Path) -> dict:
    """A YAML file of conf/ as a plain dict, its interpolations as written (read once per process)."""
    return yaml.load(path.read_text(), Loader=_ConfLoader)


@functools.cache
def groups() -> dict[str, str]:
    """{group: its default option}, from conf/train.yaml's defaults list: the sections a run's group options wrote."""
    return {k: v for entry in read_yaml(TRAIN_YAML)["defaults"] if isinstance(entry, dict) for k, v in entry.items()}


@functools.cache
def option(group: str, name: str) -> dict:
    """conf/GROUP/NAME.yaml over the options of its group that its defaults list names (`- vllm`, `_self_`),
    merged as Hydra merges them: what tells which option a saved section came from (runs.upgrade fills in composed
    values)."""
    own = dict(read_yaml(CONF_DIR / group / f"{name}.yaml"))
    merged: dict = {}
    for entry in own.pop("defaults", ["_self_"]):
        if not isinstance(entry, str):  # another group's option or an override: not a form conf/ uses
            raise ValueError(f"conf/{group}/{name}.yaml: defaults entry {entry!r} is not an option of {group}")
        merged = _merge(merged, own if entry == "_self_" else option(group, entry))
    return merged


def _merge(base: dict, over: dict) -> dict:
    """`over` merged into `base` (plain dicts) as OmegaConf.merge does: mappings key by key, anything else replaced."""
    out = dict(base)
    for key, value in over.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merge(out[key], value) if both else value
    return out


def leaves(node, prefix: str = "") -> dict[str, object]:
    """{dotted key: value} of a plain container's leaves; a list, null or empty mapping is a leaf."""
    if not isinstance(node, dict) or (not node and prefix):
        return {prefix[:-1]: node}
    return {k: v for key, value in node.items() for k, v in leaves(value, f"{prefix}{key}.").items()}


def option_of(group: str, section: dict) -> str | None:
    """The option of `group` that a saved run's `section` (a plain dict) was composed from: of the options with its
    `_target_`, the one that agrees with it on the most values (train.yaml's default first on a tie); None when no
    option has its `_target_` (a component of the user's own: nothing of ours to fill)."""
    names = sorted((p.stem for p in (CONF_DIR / group).glob("*.yaml")), key=lambda o: (o != groups()[group], o))
    have = leaves(section)
    best, most = None, -1
    for name in names:
        ours = option(group, name)
        if ours.get("_target_") != section.get("_target_"):
            continue
        agree = sum(1 for k, v in leaves(ours).items() if k in have and have[k] == v)
        if agree > most:
            best, most = name, agree
    return best


def missing_keys(saved, today, path: str, deep: bool) -> list[str]:
    """Dotted keys of `today` (an option's YAML, plain) that `saved` lacks: at any depth when `deep`, else only
    `today`'s own keys. Nothing under a node the run saved as a value (null): that was its setting."""
    out = []
    for key, value in today.items():
        if key not in saved:
            out.append(f"{path}{key}")
        elif deep and isinstance(value, dict) and isinstance(saved[key], dict):
            out += missing_keys(saved[key], value, f"{path}{key}.", deep)
    return out
