"""runs: what a saved config may build when a run folder is read back (check_saved), and what it lacks (upgrade)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from grpo_cli import files
from grpo_cli.errors import ConfigError
from grpo_cli.resources import CONF_DIR as REPO_CONF
from grpo_cli.runs import check_saved, resolved, shipped_targets


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


def _env_and_judge(tools: str) -> OmegaConf:
    return OmegaConf.create({
        "env": {"_target_": "grpo_cli.env.ToolsEnv", "tools": [f"{tools}:calc", "my_tools.search"]},
        "reward": {"_target_": "grpo_cli.rewards.OutcomeReward", "functions": {"judge": {
            "_target_": "grpo_cli.rewards.judge.judge", "_partial_": True, "base_url": "http://judge:9/v1",
            "api_key_env": "JUDGE_KEY"}}}})


def test_the_user_code_and_the_judge_a_saved_config_uses_are_named(tmp_path, capsys):
    """Outside the run folder, tools run as saved, each file and module named first; a judge's endpoint and key
    are used only when the command line gives them (or the run is trusted), and then named too."""
    saved = _env_and_judge("/home/me/tools.py")
    given = ["reward.functions.judge.base_url=http://judge:9/v1", "reward.functions.judge.api_key_env=JUDGE_KEY"]
    check_saved(saved, ["env", "reward"], given, False, tmp_path / "RUN/checkpoints/step_000001")
    err = capsys.readouterr().err
    assert "tools from /home/me/tools.py (saved with the run)" in err and "tools from module my_tools" in err
    assert "judge reward.functions.judge: completions go to http://judge:9/v1 with the key in $JUDGE_KEY" in err
    with pytest.raises(ConfigError, match=r"reward.functions.judge.base_url \(http://judge:9/v1\) is the run's"):
        check_saved(saved, ["env", "reward"], given[1:], False, tmp_path / "RUN/checkpoints/step_000001")
    with pytest.raises(ConfigError, match=r"reward.functions.judge.api_key_env \(JUDGE_KEY\) is the run's"):
        check_saved(saved, ["env", "reward"], given[:1], False, tmp_path / "RUN/checkpoints/step_000001")


def test_a_module_of_the_working_folder_inside_the_run_folder_is_refused(tmp_path, monkeypatch):
    """`grpo eval checkpoint=.` from inside a run folder: the saved `my_tools.search` would import RUN/my_tools.py."""
    run = tmp_path / "RUN"
    (run / "checkpoints/step_000001").mkdir(parents=True)
    (run / "my_tools.py").write_text("raise SystemExit('ran')\n")
    monkeypatch.chdir(run)
    with pytest.raises(ConfigError, match=r"env.tools \(my_tools\) lies inside the run folder"):
        check_saved(_env_and_judge("/home/me/tools.py"), ["env"], [], False, run / "checkpoints/step_000001")


# ---- a saved config's interpolations and its YAML: resolved and bounded before any check reads it -------------------

def test_a_saved_reference_is_resolved_before_the_checks_read_it():
    saved = OmegaConf.create({"a": {"_target_": "os.getcwd"}, "model": {"loader": "${a}"}, "n": "x${b}", "b": 3})
    plain = resolved(saved, Path("config.yaml"))
    # model.loader is the os.getcwd node itself now, where the check finds it; "x${b}" -> "x3"
    assert plain.model.loader == {"_target_": "os.getcwd"} and plain.n == "x3"


@pytest.mark.parametrize("value, named", [
    ("${oc.env:HOME}", "calls the resolver oc.env"),
    ("pre ${ oc.create : {_target_: os.getcwd} } post", "calls the resolver oc.create"),
    ("${oc.select:a, ${oc.decode:'1'}}", "calls the resolver oc.select"),
    # an escaped interpolation is text, until a reference copies it into a value that OmegaConf reads again
    ("${b}", "resolves to another interpolation"),
])
def test_a_resolver_in_a_saved_config_is_refused(value, named):
    saved = OmegaConf.create({"model": {"name_or_path": value}, "b": "\\${oc.env:HOME}"})
    with pytest.raises(ConfigError, match="trust_run_config=true") as err:
        resolved(saved, Path("config.yaml"))
    assert f"model.name_or_path {named}" in str(err.value)


def test_a_yaml_file_is_refused_before_it_is_built(tmp_path, monkeypatch):
    # the bound lowered to 1,000 nodes: the same count and refusal as at 100,000, without 5 s of pure-Python parsing
    monkeypatch.setattr(files, "YAML_MAX_NODES", 1_000)
    many = tmp_path / "many.yaml"
    many.write_text("a: [" + ", ".join(["1"] * (files.YAML_MAX_NODES + 1)) + "]\n")  # one list, 1,001 scalars
    with pytest.raises(ValueError, match="over 1,000 YAML nodes"):
        files.checked_yaml(many)
    many.write_text("a: [" + ", ".join(["1"] * (files.YAML_MAX_NODES - 3)) + "]\n")  # + the map, `a`, the list
    assert files.checked_yaml(many) == many.read_text()
    aliased = tmp_path / "aliased.yaml"
    aliased.write_text("a: &x [1]\nb: *x\n")
    with pytest.raises(ValueError, match=r"a YAML alias \(\*x\)"):
        files.checked_yaml(aliased)
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)  # reading it would block: refused from its stat alone
    with pytest.raises(ValueError, match="not a regular file"):
        files.checked_yaml(fifo)
    plain = tmp_path / "plain.yaml"
    plain.write_text("a: [1, 2]\nb: {c: d}\n")
    assert files.checked_yaml(plain) == plain.read_text()


def test_a_section_the_run_saved_as_null_stays_off_on_resume():
    """trainer.guard=null turned the guard off; today's trainer.guard.* keys are not "newer than the run" and must
    not switch it back on (a null section is the run's own setting, not a missing one)."""
    from grpo_cli.config import compose
    from grpo_cli.runs import resume_config

    saved = compose("train", ["trainer.guard=null"])
    merged = resume_config(compose("train", ["resume=somewhere"]), saved, ["resume=somewhere"])
    assert merged.trainer.guard is None
    saved = OmegaConf.create(OmegaConf.to_container(saved))
    del saved.trainer["eval_every"]  # a key the run's config lacks (saved before it existed): today's value
    merged = resume_config(compose("train", ["resume=somewhere"]), saved, ["resume=somewhere"])
    assert merged.trainer.eval_every == compose("train").trainer.eval_every


# ---- runs.upgrade: a run saved before some of today's keys existed ------------------------------------------------

OLD_RUNS = Path(__file__).resolve().parents[1] / "data" / "old_runs"


def _plain_leaves(node, prefix: str = "") -> dict:
    """{dotted key: value}; an empty mapping is a leaf."""
    plain = OmegaConf.to_container(node) if OmegaConf.is_config(node) else node
    if not isinstance(plain, dict) or (not plain and prefix):
        return {prefix.rstrip("."): plain}
    return {k: v for key, value in plain.items() for k, v in _plain_leaves(value, f"{prefix}{key}.").items()}


def _saved(*overrides: str):
    from grpo_cli.config import compose

    return OmegaConf.create(OmegaConf.to_container(compose("train", list(overrides)), resolve=True))


def test_an_older_config_is_filled_from_its_group_options_yaml():
    """tests/data/old_runs/older_config.yaml (the 2026-12-06 run's config, 22 keys deleted, the loss settings in its
    loss node) comes back as that run saved it, but for the two keys the run set on its command line
    (trainer.guard, trainer.eval_every), which an older run without them gets from conf/train.yaml."""
    from grpo_cli import checkpoint
    from grpo_cli.config import compose
    from grpo_cli.runs import upgrade

    saved = _plain_leaves(checkpoint.load_config(OLD_RUNS / "2026-12-06" / "checkpoints" / "step_000001"))
    got = _plain_leaves(upgrade(OmegaConf.load(OLD_RUNS / "older_config.yaml")))
    train_yaml = compose("train")
    set_by_the_run = {"trainer.guard": None, "trainer.eval_every": None}
    assert {k: v for k, v in saved.items() if k not in set_by_the_run} == \
        {k: v for k, v in got.items() if not k.startswith(tuple(set_by_the_run))}
    assert got["trainer.eval_every"] == train_yaml.trainer.eval_every == 10
    assert got["trainer.guard.max_rewinds"] == train_yaml.trainer.guard.max_rewinds


def test_each_section_is_filled_from_the_option_it_was_composed_from():
    """A vLLM sampler and a process reward, saved before these keys: the vllm option's and gsm8k_process's values, as
    the command composes them (reward.device, `${model.device}` in prm.yaml, reads the run's own model.device)."""
    from grpo_cli.options import option_of
    from grpo_cli.runs import upgrade

    today = _saved("sampler=vllm", "reward=gsm8k_process", "sampler.max_new_tokens=7")
    older = today.copy()
    for section, key in (("sampler", "tensor_parallel_size"), ("sampler", "weight_sync"), ("reward", "credit"),
                         ("reward", "process_weight"), ("reward", "worker")):
        del older[section][key]
    assert option_of("sampler", OmegaConf.to_container(older.sampler)) == "vllm"
    assert option_of("reward", OmegaConf.to_container(older.reward)) == "gsm8k_process"
    assert upgrade(older) == today
    prm = _saved("reward=prm", "reward.name_or_path=x", "model=tiny")
    del prm.reward["device"]
    prm.model.device = "cuda:1"
    assert upgrade(prm).reward.device == "cuda:1"


def test_what_the_run_left_out_itself_stays_out():
    """A reward function the run removed (~reward.functions.accuracy), a section it saved as null (trainer.guard=null),
    a component of the user's own (no option has its _target_) and an option's key another option lacks: nothing
    added. A config that lacks nothing comes back as it is."""
    from grpo_cli.runs import upgrade

    saved = _saved("~reward.functions.accuracy", "~reward.weights.accuracy", "trainer.guard=null",
                   "+reward.functions.any={_target_:grpo_cli.rewards.outcome.format_reward,_partial_:true}")
    assert upgrade(saved) is saved
    own = saved.copy()
    own.data = {"_target_": "my_data.Task", "seed": 0}
    own.reward = {"_target_": "my_rewards.Reward"}
    assert upgrade(own) == own
    del saved.model["finetune"]
    got = upgrade(saved)
    assert got.model.finetune == "lora" and "accuracy" not in got.reward.functions and got.trainer.guard is None
    assert "name_or_path" not in got.model  # model=hf's key: this run's model (smollm2_135m) has none


def test_the_options_read_for_matching_are_what_hydra_composes():
    """options.option merges an option over those its defaults list names, as Hydra does: for every option built on
    another one, the composed section, key for key and value for value."""
    from grpo_cli.config import compose
    from grpo_cli.options import groups, option

    chained = [(g, p.stem) for g in groups() for p in sorted((REPO_CONF / g).glob("*.yaml"))
               if "defaults" in p.read_text()]
    assert len(chained) >= 7
    for group, name in chained:
        assert option(group, name) == OmegaConf.to_container(compose("train", [f"{group}={name}"])[group]), \
            f"{group}={name}"
