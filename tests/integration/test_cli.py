"""The CLI as a user runs it: subcommands, Hydra features, recipes, config errors, sweeps."""

from __future__ import annotations

import copy
from http.server import BaseHTTPRequestHandler

import pytest
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from grpo_cli.commands import train
from grpo_cli.config import compose, validate
from grpo_cli.errors import ConfigError
from grpo_cli.resources import CONF_DIR, RECIPES_DIR
from tests.helpers.cli import run_cli
from tests.helpers.judge import LocalServer
from tests.helpers.tools import MULTIPLY_TOOL


def test_help_lists_subcommands():
    out = run_cli(["--help"])
    assert out.returncode == 0
    for command in ("train", "eval", "sample"):
        assert command in out.stdout


def test_unknown_command_exits_2():
    out = run_cli(["fly"])
    assert out.returncode == 2 and "unknown command" in out.stderr


def test_cfg_job_with_recipe_prints_every_section(tmp_path):
    out = run_cli(["train", "--cfg", "job", "+recipe=gsm8k"], cwd=tmp_path)  # from another working directory
    assert out.returncode == 0, out.stderr
    cfg = OmegaConf.create(out.stdout)
    for section in ("model", "reward", "sampler", "optimizer", "data", "algo", "trainer"):
        assert section in cfg, section
    assert cfg.data._target_.endswith("GSM8KTask")


def test_invalid_value_exits_2_with_one_line(tmp_path):
    out = run_cli(["train", "sampler.temperature=-1", f"hydra.run.dir={tmp_path}"])
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "sampler.temperature" in lines[0] and "set sampler.temperature=" in lines[0]


def test_every_problem_is_reported_at_once(tmp_path):
    out = run_cli(["train", "model=tiny", "algo.group_size=1", "sampler.temperature=-1", "trainer.prompts_per_step=0",
                   "+sampler.temprature=0.7", f"hydra.run.dir={tmp_path}"])
    assert out.returncode == 2 and "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 4, out.stderr  # three bad values and one unknown key, one line each
    for key in ("algo.group_size", "sampler.temperature", "trainer.prompts_per_step", "sampler.temprature"):
        assert sum(line.startswith(f"error: {key} ") for line in lines) == 1, key
    assert all(" set " in line or "use one of" in line for line in lines)  # each names its fix
    assert not (tmp_path / "metrics.jsonl").exists()  # stopped before any work


def test_allowed_values_come_from_the_module_that_owns_them():
    from grpo_cli.objective import KL_ESTIMATORS, LOSS_TYPES

    composed = compose("train")  # each value set on a copy (validate resolves its config in place): no recompose
    for key, values in (("algo.loss_type", LOSS_TYPES), ("algo.kl_estimator", KL_ESTIMATORS)):
        for value in ("nope", *values):
            cfg = copy.deepcopy(composed)
            OmegaConf.update(cfg, key, value)
            if value != "nope":
                validate(cfg)
                continue
            with pytest.raises(ConfigError) as err:
                validate(cfg)
            assert all(v in str(err.value) for v in values), key


def test_unknown_key_in_a_component_names_the_fix():
    cfg = compose("train", ["sampler=short", "+sampler.temprature=0.7"])
    with pytest.raises(ConfigError, match=r"sampler.temprature is not a parameter of grpo_cli.rollout.hf.HFSampler"):
        validate(cfg)
    # sampler=auto (the default) takes vLLM's sampler's keys, whichever engine it picks
    with pytest.raises(ConfigError, match=r"sampler.temprature is not a parameter of grpo_cli.rollout.engine.auto; "
                                          r"remove it or use one of: temperature, top_p"):
        validate(compose("train", ["+sampler.temprature=0.7"]))


def test_bad_data_path_is_one_line(tmp_path):
    out = run_cli(["train", "data=gsm8k", f"data.path={tmp_path}/nope.jsonl", "model=tiny",
                   f"hydra.run.dir={tmp_path}/run"])
    assert out.returncode == 2, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "nope.jsonl" in out.stderr


@pytest.mark.parametrize("recipe", sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")))
def test_every_recipe_composes_and_instantiates(recipe, gsm8k_path):
    cfg = compose("train", [f"+recipe={recipe}"])
    overrides = [f"+recipe={recipe}"]
    if "path" in cfg.data:  # a file-backed task: point it at the local GSM8K copy
        overrides.append(f"data.path={gsm8k_path}")
    if OmegaConf.is_missing(cfg.reward, "name_or_path"):  # a recipe that starts from a model the user gives
        overrides.append("reward.name_or_path=some/model")
    cfg = compose("train", overrides)
    validate(cfg, *train.CHECKS)
    # iterative RL trains its reward model at step 1 (reward.name_or_path null until then): it builds no reward here
    for section in ("data", "sampler") if cfg.iterative.iterations else ("data", "reward", "sampler"):
        assert instantiate(cfg[section], _convert_="all") is not None
    assert callable(instantiate(cfg.optimizer))


GROUPS = sorted((p.parent.name, p.stem) for p in CONF_DIR.glob("*/*.yaml"))
# a tool and a TRL-style environment class, for the env options
MY_ENV = MULTIPLY_TOOL + '''

class Game:
    def reset(self, **row):
        return None

    def guess(self, n: int) -> str:
        """Guess the number.

        Args:
            n: the guess
        """
        return "higher"
'''


@pytest.mark.parametrize("group,option", GROUPS)
def test_every_group_option_composes(group, option, gsm8k_path, monkeypatch, tmp_path):
    overrides = [f"{group}={option}"]
    if group == "env" or (group, option) == ("data", "env"):  # the checks build the tools and the class
        (tmp_path / "my_env.py").write_text(MY_ENV)
        overrides += {"tools": [f"env.tools=[{tmp_path / 'my_env.py'}:multiply]"],
                      "class": [f"env.factory={tmp_path / 'my_env.py'}:Game"]}.get(option, [])
    if (group, option) == ("data", "env"):  # environment-owned data: the class writes each prompt
        overrides += ["env=class", f"env.factory={tmp_path / 'my_env.py'}:Game"]
    if group == "sampler" and option.startswith("vllm"):  # vLLM installed or not (test_vllm_sampler)
        monkeypatch.setattr("grpo_cli.rollout.vllm_engine.installed", lambda: True)
    server = LocalServer(AnswersGet)  # sampler=vllm_server's check asks a server before anything loads: a stand-in
    if group == "sampler" and option.startswith("vllm_server"):
        overrides.append(f"sampler.url={server.url.removesuffix('/v1')}")
    if (group, option) in (("model", "hf"),):
        overrides.append("model.name_or_path=some/model")
    if group == "data" and option in ("gsm8k", "jsonl", "hf"):
        overrides.append(f"data.path={gsm8k_path}")
    if (group, option) == ("reward", "custom"):
        overrides.append("reward.funcs=[accuracy]")
    if group == "reward" and option in ("orm", "prm"):
        overrides.append("reward.name_or_path=some/model")
    if (group, option) == ("reward", "judge"):
        overrides.append("reward.functions.judge.model=some/model")
    # the labeler and rm groups belong to both `grpo rm` and `grpo train` (its iterations)
    with server:
        for command in ("rm", "train") if group in ("labeler", "rm") else ("train",):
            validate(compose(command, overrides))


class AnswersGet(BaseHTTPRequestHandler):
    """200 and an empty JSON object to any GET."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


def test_sweep_runs_two_jobs(tmp_path):
    out = run_cli(["train", "-m", "model=tiny", "trainer.max_steps=1", "sampler.max_new_tokens=4",
                   "algo.group_size=2", "trainer.prompts_per_step=1", "trainer.report_to=[]",
                   "trainer.eval_every=null",  # the jobs, not a held-out eval (3/4 of their time)
                   "algo.beta=0,0.04", f"hydra.sweep.dir={tmp_path}"])
    assert out.returncode == 0, out.stderr[-2000:]
    for job in ("0", "1"):
        assert (tmp_path / job / "metrics.jsonl").exists()
        assert (tmp_path / job / ".hydra" / "config.yaml").exists()
        assert (tmp_path / job / "checkpoints" / "step_000001" / "adapter_model.safetensors").exists()
    betas = {OmegaConf.load(tmp_path / j / ".hydra" / "config.yaml").algo.beta for j in ("0", "1")}
    assert betas == {0, 0.04}


def _dotted_keys(node, prefix: str = "") -> set[str]:
    """Every dotted key of a composed config, leaves and sections, without resolving interpolations."""
    keys = set()
    for key in node.keys():
        path = f"{prefix}{key}"
        keys.add(path)
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            keys |= _dotted_keys(child, path + ".")
    return keys


def test_every_rule_names_a_key_that_some_composed_config_has():
    """A renamed YAML key must not switch its rule off silently: each Rule's key exists in a composed config of
    some command with some group option (a rule's key absent from a config is skipped by design)."""
    from grpo_cli import config
    from grpo_cli.checks import Rule
    from grpo_cli.commands import evaluate, rm, sample

    commands = ("train", "eval", "sample", "rm", "export")
    keys = set().union(*(_dotted_keys(compose(command)) for command in commands))
    for group, option in GROUPS:
        # an option's keys are its YAML file's whatever the command: the first command that composes it shows them
        for command in commands:
            try:
                keys |= _dotted_keys(compose(command, [f"{group}={option}"]))
                break
            except Exception:  # a group that command does not compose
                continue
    rules = [c for c in (*config.LIBRARY_CHECKS, *train.CHECKS, *evaluate.CHECKS, *sample.CHECKS, *rm.CHECKS)
             if isinstance(c, Rule)]
    assert len(rules) > 50
    missing = sorted({rule.key for rule in rules if rule.key not in keys})
    assert not missing, f"rules whose key no composed config has (renamed in conf/?): {missing}"
    assert "trainer.max_step" not in keys  # the check can see a key that is not there
