"""grpo_cli/user_code.py: `load_function` resolves a name a setting gives (`module.fn`, `path/file.py:fn`, a
built-in's short name) for every part that takes the user's functions: rewards, tools, environments."""

from __future__ import annotations

import pytest

from grpo_cli import user_code
from grpo_cli.errors import ConfigError


def test_load_function_resolves_a_file_a_module_and_a_built_in(tmp_path, monkeypatch):
    # a name no other test's file has: a module imported once stays in sys.modules for the rest of the process
    (tmp_path / "lf_rewards.py").write_text("def fn(prompts, completions, **kwargs):\n    return [1.0]\n")
    monkeypatch.chdir(tmp_path)
    name, fn = user_code.load_function(f"{tmp_path / 'lf_rewards.py'}:fn", "reward.funcs[0]")
    assert (name, fn(prompts=[], completions=[])) == ("fn", [1.0])
    name, fn = user_code.load_function("lf_rewards.fn", "reward.funcs[0]")  # the working folder's own module
    assert (name, fn.__module__) == ("fn", "lf_rewards")

    def given(**_):
        return [0.5]

    assert user_code.load_function("accuracy", "reward.funcs[0]", {"accuracy": given}) == ("accuracy", given)
    with pytest.raises(ConfigError, match=r"reward.funcs\[0\] \(accuracy\) is not a built-in \(\)"):
        user_code.load_function("accuracy", "reward.funcs[0]")  # no built-ins given: a bare name is no function


def test_rewards_tools_and_environments_share_one_resolver():
    from grpo_cli.env import environments, tools
    from grpo_cli.rewards import user

    assert tools.load_function is environments.load_function is user.load_function is user_code.load_function
