"""The `env` group's YAML builds, and its checks answer a bad limit or a bad tool with one line each, from the
config alone (before any model loads)."""

from __future__ import annotations

import sys

import pytest
from omegaconf import OmegaConf

from grpo_cli.env import CHECKS, ClassEnv, ToolsEnv
from grpo_cli.instantiate import build
from tests.helpers import REPO

TOOL = '''
def multiply(a: int, b: int) -> int:
    """Multiply.

    Args:
        a: the first
        b: the second
    """
    return a * b


def bare(a, b):
    """Multiply.

    Args:
        a: the first
        b: the second
    """
    return a * b


class NoReset:
    def move(self, where: str) -> str:
        """Move.

        Args:
            where: the direction
        """
        return where


class Game:
    def reset(self, **row):
        return None

    def move(self, where: str) -> str:
        """Move.

        Args:
            where: the direction
        """
        return where
'''


def env_cfg(option: str, **values):
    node = OmegaConf.load(REPO / "conf" / "env" / f"{option}.yaml")
    return OmegaConf.merge(OmegaConf.create({"env": node}), OmegaConf.create({"env": values}))


def problems(cfg) -> list[str]:
    return [line for check in CHECKS for line in check(cfg)]


@pytest.fixture()
def user_files(tmp_path, monkeypatch):
    (tmp_path / "limit_tools.py").write_text(TOOL)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "limit_tools", raising=False)


def test_each_option_of_the_group_builds(user_files):
    assert env_cfg("none").env._target_ is None and problems(env_cfg("none")) == []  # no env node to build
    assert isinstance(build(env_cfg("tools", tools=["limit_tools.multiply"]).env), ToolsEnv)
    assert isinstance(build(env_cfg("class", factory="limit_tools.Game").env), ClassEnv)
    assert problems(env_cfg("tools", tools=["limit_tools.multiply"])) == []


@pytest.mark.parametrize("key, value, expected", [
    ("max_turns", 0, "env.max_turns (0) must be an integer >= 1"),
    ("max_tool_calls", -1, "env.max_tool_calls (-1) must be an integer >= 0"),
    ("max_episode_tokens", 0, "env.max_episode_tokens (0) must be an integer >= 1"),
    ("tool_timeout_s", 0, "env.tool_timeout_s (0) must be a number of seconds > 0"),
    ("max_result_chars", 0, "env.max_result_chars (0) must be an integer >= 1"),
    ("tool_format", "xml", "env.tool_format ('xml') must be auto, template or chatml"),
])
def test_a_bad_limit_is_one_line_naming_the_fix(user_files, key, value, expected):
    lines = problems(env_cfg("tools", tools=["limit_tools.multiply"], **{key: value}))
    assert len(lines) == 1 and lines[0].startswith(expected) and f"set env.{key}=" in lines[0], lines


def test_a_bad_tool_or_class_is_caught_by_the_checks(user_files):
    (tool,) = problems(env_cfg("tools", tools=["limit_tools.bare"]))
    assert tool.startswith("env.tools[0] (limit_tools.bare): Argument a is missing a type hint")
    (game,) = problems(env_cfg("class", factory="limit_tools.NoReset"))
    assert "has no reset method" in game
