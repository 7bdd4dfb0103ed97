"""Shared fixtures: a tiny seeded random Llama + character tokenizer (no files, no network), and one trained tiny run
that the integration tests of eval/sample/export/rm/resume read. The helpers behind them live in tests/helpers/, one
module a subject."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

# a pytest-xdist worker (make test runs 2) gets COLUMNS=80 from xdist; the console would then wrap its lines at 80
# where a plain pytest process, piped, writes them whole (grpo_cli.metrics.console), and tests read those lines
if os.environ.get("PYTEST_XDIST_WORKER"):
    for name in ("COLUMNS", "LINES"):
        os.environ.pop(name, None)

from grpo_cli.cli import setup_process  # noqa: E402

# the tests run the library as the `grpo` command does: its process set up once (environment, warnings)
setup_process()
# sampler=auto (the default) samples with HF generate here, as the pinned numbers were measured, whether or not vLLM
# is installed; a test of the engine choice or of vLLM says so (sampler=vllm, or this variable removed)
os.environ.setdefault("GRPO_NO_VLLM", "1")

# after the process setup
from tests.helpers import GSM8K, REPO  # noqa: E402
from tests.helpers.cli import parse_each_yaml_text_once, release_vllm_groups, run_cli  # noqa: E402
from tests.helpers.runs import EVAL_TINY, TINY, copy_run, tiny_cfg  # noqa: E402

# the suite composes ~770 configs: each YAML text parsed once (tests.helpers.cli.parse_each_yaml_text_once)
parse_each_yaml_text_once()

__all__ = ["REPO", "GSM8K"]


@pytest.fixture(scope="session")
def tiny():
    """(model, tokenizer): 2-layer random Llama over grpo_cli.policy.char_tokenizer."""
    from grpo_cli.policy import load_tiny_random

    model, tokenizer = load_tiny_random()
    model.eval()
    return model, tokenizer


@pytest.fixture(scope="module", autouse=True)
def vllm_groups_released():
    """A module that starts an in-process vLLM engine (a module fixture's, a test's) leaves no process group to the
    next: torch.distributed is process state, and a later test that makes its own group would find vLLM's."""
    yield
    release_vllm_groups()


@pytest.fixture()
def gsm8k_path() -> Path:
    if not GSM8K.exists():
        pytest.skip(f"GSM8K not found at {GSM8K} (it lives in ../shared/data beside the repo)")
    return GSM8K


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> Path:
    """One finished `grpo train` run of the tiny model (tests.helpers.runs.TINY, 2 steps, a checkpoint at each), made
    once per session through the command itself. Tests read it; a test that resumes or damages a run works on
    `trained_run_copy`."""
    folder = tmp_path_factory.mktemp("trained") / "run"
    code, _, err = run_cli(["train", *TINY, "trainer.max_steps=2", "trainer.save_every=1",
                            f"hydra.run.dir={folder}"])
    assert code == 0, err[-3000:]
    return folder


# `four_step_run`'s settings on top of tests.helpers.runs.TINY
FOUR_STEPS = ["trainer.max_steps=4", "trainer.save_every=1", "trainer.keep_last=null",
              "trainer.log_completions_every=1", "trainer.num_completions_to_print=0"]


@pytest.fixture(scope="session")
def four_step_run(tmp_path_factory) -> Path:
    """One finished 4-step tiny run (tests.helpers.runs.TINY) with a checkpoint at every step, none removed, and every
    step's completions in completions.jsonl, made once per session: the straight run that exact-resume tests
    compare a split run with (metrics, weights, completions), and the run that resume and guard tests read. Checkpoints
    and logging change no number of a run, so one run serves them all. Tests that resume or damage it work on a copy
    (tests.helpers.runs.copy_run)."""
    from grpo_cli.commands import train

    folder = tmp_path_factory.mktemp("four_steps") / "run"
    train.run(tiny_cfg(*FOUR_STEPS), folder)
    return folder


def _eval_run(folder: Path, *overrides: str) -> Path:
    from grpo_cli.commands import train
    from grpo_cli.config import compose

    train.run(compose("train", [*EVAL_TINY, "trainer.max_steps=2", "trainer.save_every=1", "algo.group_size=2",
                                "trainer.prompts_per_step=1", "trainer.report_to=[]", "trainer.eval_every=null",
                                *overrides]), folder)
    return folder


@pytest.fixture(scope="session")
def eval_run(tmp_path_factory) -> Path:
    """A 2-step tiny run (tests.helpers.runs.EVAL_TINY) with checkpoints at steps 1 and 2, for eval and sample to read.
    Tests copy it before they change anything."""
    return _eval_run(tmp_path_factory.mktemp("eval_run"))


@pytest.fixture(scope="session")
def wide_eval_run(tmp_path_factory) -> Path:
    """`eval_run` on another tiny base model: hidden size 64 instead of 32."""
    return _eval_run(tmp_path_factory.mktemp("wide_eval_run"), "model.loader.hidden_size=64")


@pytest.fixture()
def no_model(monkeypatch):
    """Any model load fails the test: the errors it checks must come before one."""
    from grpo_cli import policy

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(policy, "build_policy", refuse)


@pytest.fixture()
def trained_run_copy(trained_run, tmp_path) -> Path:
    """A copy of `trained_run` of this test's own."""
    return copy_run(trained_run, tmp_path / "run")


@pytest.fixture()
def tmpfs(tmp_path):
    """Mount a small tmpfs (needs root, as on this project's machines and CI); yields a mount function."""
    mounted = []

    def mount(name: str, options: str) -> Path:
        where = tmp_path / name
        where.mkdir()
        out = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True)
        if out.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({out.stderr.decode().strip()}); needs root")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)])


SYSTEM_LIMIT = 15  # tests/system holds only the cases whose subject is the process itself (docs/development.md)


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    """Refuse a 16th system case (parametrized cases count), before -m or -k deselects any; then, once they have
    deselected, put the longest modules first."""
    system = [item.nodeid for item in items if item.nodeid.startswith("tests/system/")]
    if len(system) > SYSTEM_LIMIT:
        raise pytest.UsageError(f"tests/system holds {len(system)} cases, more than {SYSTEM_LIMIT}: keep there only "
                                f"what needs its own process (docs/development.md, The test suite)")
    result = yield
    # the longest modules first (the workers take whole modules in this order, --no-loadscope-reorder): started
    # last, one of them would keep one worker busy for a minute while the other stands idle. Judged by the tests
    # that run, after -m: in `make test` (the fast tier) a module that also holds a ci test is no longer long; in
    # `make test-ci` every module is a ci one, and tests/system's (torchrun, a vLLM process: the longest) go first
    system_modules = {item.path for item in items if item.nodeid.startswith("tests/system/")}
    ci_modules = {item.path for item in items if item.get_closest_marker("ci")}
    items.sort(key=lambda item: (item.path not in system_modules, item.path not in ci_modules))
    return result
