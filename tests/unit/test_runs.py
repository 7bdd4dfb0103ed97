"""runs.check_saved: what a saved config may build when a run folder is read back."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from grpo_cli.errors import ConfigError
from grpo_cli.runs import check_saved, shipped_targets


def test_the_shipped_targets_are_those_conf_and_recipes_name():
    assert {"grpo_cli.rewards.user.CustomReward", "torch.optim.AdamW", "grpo_cli.policy.load_tiny_random"} <= \
        shipped_targets()
    assert "pathlib.Path.write_text" not in shipped_targets() and "grpo_cli.files.write_text" not in shipped_targets()


@pytest.mark.parametrize("model, named", [
    ({"loader": {"_target_": "grpo_cli.policy.load_pretrained", "trust_remote_code": "yes"}},
     "model.loader.trust_remote_code"),
    ({"loader": {"_target_": {"nested": 1}}}, "model.loader._target_"),
    ({"loader": {"_target_": "grpo_cli.policy.load_pretrained", "kwargs": [{"a": [{"_target_": "os.getcwd"}]}]}},
     "model.loader.kwargs.0.a.0._target_ (os.getcwd)"),
])
def test_code_a_saved_config_names_is_refused_naming_the_node(model, named):
    saved = OmegaConf.create({"model": model})
    with pytest.raises(ConfigError) as err:
        check_saved(saved, ["model"], [], False, Path("RUN/checkpoints/step_000001"))
    assert named in str(err.value) and "\n" not in str(err.value)
    check_saved(saved, ["model"], [], True, Path("RUN/checkpoints/step_000001"))  # trusted: built as it is
