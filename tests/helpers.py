"""What several test files share."""

from __future__ import annotations

import functools
from pathlib import Path

from omegaconf import OmegaConf

from grpo_cli.config import compose

REPO = Path(__file__).resolve().parent.parent


@functools.cache
def _sampler_section(option: str) -> dict:
    section = OmegaConf.to_container(compose("train", [f"sampler={option}"]).sampler, resolve=True)
    return {k: v for k, v in section.items() if not k.startswith("_")}


def sampler_settings(option: str = "default", **overrides) -> dict:
    """The keyword arguments of conf/sampler/OPTION.yaml's sampler as a command composes them, `overrides` on top:
    a test that builds a sampler by hand names only the values it is about
    (`HFSampler(**sampler_settings(max_new_tokens=8))`), and the YAML stays the settings' one home."""
    return {**_sampler_section(option), **overrides}
