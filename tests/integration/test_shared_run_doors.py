"""Every door through which a shared run folder's config.yaml could run code, read a secret or reach a server is
guarded: one payload planted per door, then each command that reads that part of the run (eval, sample, resume,
export, rm) stops with exit 2 and one line, with no side effect and no request (docs/runs.md, "A run folder is data").

A payload's side effect is a marker file its code would write, or a request a local server would receive."""

from __future__ import annotations

import http.server
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.helpers.cli import one_line_error, run_cli
from tests.helpers.judge import LocalServer

SECRET = "GRPO_TEST_DOOR_SECRET"
# the sections each command reads back from a run (inference.INHERITED, export's model, rm's model/data/sampler)
READS = {"eval": {"model", "data", "reward", "sampler", "env"},
         "sample": {"model", "data", "reward", "sampler", "env"},
         "resume": {"model", "data", "reward", "sampler", "env", "algo", "trainer"}, "export": {"model"},
         "rm": {"model", "data", "sampler"}}


class Recorder(http.server.BaseHTTPRequestHandler):
    """A judge endpoint that records every request it gets (and answers none usefully)."""

    seen: list[dict] = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        Recorder.seen.append(dict(self.headers))
        self.send_response(500)
        self.end_headers()

    do_GET = do_POST  # noqa: N815

    def log_message(self, *args):
        pass


@pytest.fixture()
def endpoint():
    Recorder.seen = []
    with LocalServer(Recorder) as server:
        yield server.url


def _code(marker: Path, body: str) -> str:
    """A Python file whose top-level code writes `marker`, then defines `body`."""
    return f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n{body}\n"


FN = ("def fn(prompts=None, completions=None, **kwargs):\n    '''A tool.\n\n    Args:\n        prompts: any\n"
      "    '''\n    return [0.0] * len(completions or [])\n")
ENV = "class Env:\n    def reset(self, **kwargs):\n        return None\n"


def _write_node(marker: Path) -> dict:
    return {"_target_": "pathlib.Path.write_text", "self": {"_target_": "pathlib.Path", "_args_": [str(marker)]},
            "data": "x" * 32}


# each door: (section it lives in, plant(cfg dict, run folder, marker, endpoint) -> None, what the one line names)
def _target(cfg, run, marker, url):
    cfg["model"]["loader"]["hidden_size"] = _write_node(marker)


def _remote_code(cfg, run, marker, url):
    cfg["model"]["trust_remote_code"] = True


def _interpolation(cfg, run, marker, url):
    # the check must see what validate() would build from it: a write_text node, not a string
    cfg["model"]["loader"]["hidden_size"] = (
        "${oc.create:{_target_: pathlib.Path.write_text, self: {_target_: pathlib.Path, _args_: ['" + str(marker)
        + "']}, data: xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx}}")


def _env_var(cfg, run, marker, url):
    # a secret read into a value the run would send somewhere (a hub id, a URL)
    cfg["model"]["name_or_path"] = "${oc.env:" + SECRET + "}"


def _nested_reward(cfg, run, marker, url):
    (run / "evil_reward.py").write_text(_code(marker, FN))
    cfg["reward"] = {"_target_": "grpo_cli.rewards.OutcomeReward",
                     "functions": {"mine": {"_target_": "grpo_cli.rewards.user.CustomReward",
                                            "funcs": [f"{run / 'evil_reward.py'}:fn"], "weights": None,
                                            "timeout_s": 10, "worker": "thread"}},
                     "weights": {"mine": 1.0}, "timeout_s": 10, "worker": "thread"}


def _tools(cfg, run, marker, url):
    (run / "tools.py").write_text(_code(marker, FN))
    cfg["env"] = {**OmegaConf.to_container(OmegaConf.load(_conf("env/tools.yaml"))), "tools": [f"{run}/tools.py:fn"]}


def _factory(cfg, run, marker, url):
    (run / "game.py").write_text(_code(marker, ENV))
    cfg["env"] = {**OmegaConf.to_container(OmegaConf.load(_conf("env/class.yaml"))), "factory": f"{run}/game.py:Env"}


def _class_tools(cfg, run, marker, url):
    # env=class with plain tools beside its class: the class a module outside the run folder, the tools inside it
    (run / "tools.py").write_text(_code(marker, FN))
    cfg["env"] = {**OmegaConf.to_container(OmegaConf.load(_conf("env/class.yaml"))),
                  "factory": "collections.OrderedDict", "tools": [f"{run}/tools.py:fn"]}


def _factory_map(cfg, run, marker, url):
    # env=class with a class per row, by name
    (run / "game.py").write_text(_code(marker, ENV))
    cfg["env"] = {**OmegaConf.to_container(OmegaConf.load(_conf("env/class.yaml"))),
                  "factory": {"game": f"{run}/game.py:Env"}}


def _judge(cfg, run, marker, url):
    judge = OmegaConf.to_container(OmegaConf.load(_conf("reward/judge.yaml")))
    judge["functions"]["judge"].update(base_url=url, model="judge", api_key_env=SECRET)
    cfg["reward"] = judge


def _data_fifo(cfg, run, marker, url):
    fifo = run / "problems.jsonl"
    if not fifo.exists():
        os.mkfifo(fifo)
    cfg["data"] = {**OmegaConf.to_container(OmegaConf.load(_conf("data/jsonl.yaml"))), "path": str(fifo)}


def _conf(name: str) -> Path:
    from grpo_cli.resources import CONF_DIR

    return CONF_DIR / name


DOORS: dict[str, tuple[str, Callable, str]] = {
    "target": ("model", _target, "model.loader.hidden_size._target_ (pathlib.Path.write_text)"),
    "remote_code": ("model", _remote_code, "model.trust_remote_code"),
    "interpolation": ("model", _interpolation, "model.loader.hidden_size"),
    "env_variable": ("model", _env_var, "oc.env"),
    "nested_reward": ("reward", _nested_reward, "reward.functions.mine.funcs"),
    "tools": ("env", _tools, "env.tools"),
    "factory": ("env", _factory, "env.factory"),
    "class_tools": ("env", _class_tools, "env.tools"),
    "factory_map": ("env", _factory_map, "env.factory"),
    "judge": ("reward", _judge, "reward.functions.judge.base_url"),
    "data_fifo": ("data", _data_fifo, "data.path"),
}


def _argv(command: str, run: Path, out: Path) -> list[str]:
    return {"eval": ["eval", f"checkpoint={run}", "eval.limit=2", f"hydra.run.dir={out}"],
            "sample": ["sample", f"checkpoint={run}", "sample.num_prompts=1", "sample.n=1", f"hydra.run.dir={out}"],
            "resume": ["train", f"resume={run}", "trainer.max_steps=3"],
            "export": ["export", f"checkpoint={run}", f"output={out / 'model'}", f"hydra.run.dir={out}"],
            "rm": ["rm", f"checkpoint={run}", "rm.num_problems=2", "rm.samples_per_problem=2",
                   f"hydra.run.dir={out}"]}[command]


CASES = [(door, command) for door, (section, _, _) in DOORS.items() for command in READS if section in READS[command]]


def _plant(run: Path, door: str, marker: Path, url: str) -> None:
    """The door's payload in every checkpoint's config.yaml of `run` (each planter may run more than once)."""
    _, plant, _ = DOORS[door]
    for config in run.glob("checkpoints/step_*/config.yaml"):
        cfg = OmegaConf.to_container(OmegaConf.load(config), resolve=False)
        plant(cfg, run, marker, url)
        config.write_text(OmegaConf.to_yaml(OmegaConf.create(cfg)))


@pytest.mark.parametrize(("door", "command"), CASES, ids=[f"{d}-{c}" for d, c in CASES])
def test_a_planted_door_stops_the_command(trained_run_copy, tmp_path, endpoint, door, command):
    marker = tmp_path / "marker"
    _plant(trained_run_copy, door, marker, endpoint)
    result = run_cli(_argv(command, trained_run_copy, tmp_path / "out"), env={SECRET: "s3cr3t-value"})
    line = one_line_error(result)
    assert DOORS[door][2] in line, line
    # a data.path that is no regular file is refused for trusted runs too: the line names what to set instead
    assert ("trust_run_config=true" in line) != (door == "data_fifo"), line
    assert "s3cr3t-value" not in result.stderr + result.stdout
    assert not marker.exists(), f"{door}: the planted code ran on grpo {command}"
    assert Recorder.seen == [], f"{door}: grpo {command} sent {len(Recorder.seen)} request(s)"


def test_every_door_is_planted_for_every_command_that_reads_it():
    """The table above covers each command: a door in the model section is tried on all five."""
    assert {c for d, c in CASES if d == "target"} == set(READS)
    assert {d for d, c in CASES if c == "export"} == {d for d, (s, _, _) in DOORS.items() if s == "model"}


def test_a_yaml_alias_bomb_is_refused_before_it_is_expanded(trained_run_copy, tmp_path):
    """Nine levels of ten aliases each would expand to 10^9 nodes; the file itself is a few hundred bytes."""
    bomb = "a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 10))
    for config in trained_run_copy.glob("checkpoints/step_*/config.yaml"):
        config.write_text(config.read_text() + bomb)
    for command in READS:
        result = run_cli(_argv(command, trained_run_copy, tmp_path / command))
        lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
        # eval reads every checkpoint of the run, and names each one that cannot be read
        assert len(lines) == (2 if command == "eval" else 1), lines
        assert all("config.yaml cannot be read (it holds a YAML alias (*a0)" in line for line in lines), lines
