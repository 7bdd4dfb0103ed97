"""The command harness: `run_cli` runs a command in this process as the console script runs it and puts back what
the command changed; readers of a refusal's one line; a command in a child process; the suite's YAML parse cache."""

from __future__ import annotations

import contextlib
import copy
import importlib
import io
import logging
import os
import signal
import subprocess
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from grpo_cli.cli import main as grpo_main
from tests.helpers import REPO


def release_vllm_groups() -> None:
    """End the process groups an in-process vLLM engine made (its world, its tensor-parallel group and
    torch.distributed's default group), as the engine's shutdown does at a process's exit. Left alive in the test
    process, they outlive the test that started the engine and a later test that makes its own group finds one
    already there (torch.distributed is process state). Nothing to do when vLLM never made a group here."""
    parallel_state = sys.modules.get("vllm.distributed.parallel_state")
    if parallel_state is not None and parallel_state.model_parallel_is_initialized():
        parallel_state.cleanup_dist_env_and_memory()


# ---- the command harness ------------------------------------------------------------------------------------------

class CliResult(NamedTuple):
    """What `grpo ...` left: a (code, out, err) tuple, read also as subprocess.CompletedProcess is read."""

    returncode: int
    stdout: str
    stderr: str


def run_cli(argv: Sequence[str], cwd: Path | str | None = None, env: dict[str, str] | None = None,
            threads: int | None = None) -> CliResult:
    """(exit code, stdout, stderr) of `grpo ARGV...` run in this process, as the console script runs it
    (grpo_cli.cli.main: its dispatch, its process setup), from `cwd` (the repo by default).

    An exception that escapes the command ends as the interpreter would end it: its traceback on stderr, exit 1.
    What a command changes in the process is put back: sys.argv, sys.path, the working directory, the environment
    (`env` is added to it for the call; HYDRA_FULL_ERROR is dropped, as for a user), signal handlers, the root
    logger's handlers and level, which loggers are disabled, torch's thread count, the modules the command imported
    from `cwd` (a user's reward file that the next call's folder holds under the same name), and the process groups
    of an in-process vLLM engine the command started (`release_vllm_groups`)."""
    cwd = Path(cwd or REPO).resolve()
    saved_argv, saved_path, saved_cwd, saved_env = sys.argv[:], sys.path[:], os.getcwd(), dict(os.environ)
    saved_signals = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    # Hydra's job_logging=disabled (grpo serve, a rank other than 0) disables every logger that exists: the later
    # tests' warnings would reach no caplog
    saved_disabled = {name: lg.disabled for name, lg in logging.root.manager.loggerDict.items()
                      if isinstance(lg, logging.Logger)}
    saved_modules = set(sys.modules)
    torch = sys.modules.get("torch")
    saved_threads = torch.get_num_threads() if torch else None
    parallel_state = sys.modules.get("vllm.distributed.parallel_state")
    had_groups = parallel_state is not None and parallel_state.model_parallel_is_initialized()
    out, err = io.StringIO(), io.StringIO()
    os.environ.pop("HYDRA_FULL_ERROR", None)
    os.environ.update(env or {})
    os.chdir(cwd)
    if threads is not None:  # torch's intra-op threads for the call, as OMP_NUM_THREADS sets them in a new process
        torch.set_num_threads(threads)
    importlib.invalidate_caches()  # a file the test just wrote in cwd is importable
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                grpo_main(list(argv))
                code = 0
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
                if not isinstance(stop.code, (int, type(None))):
                    print(stop.code, file=sys.stderr)
            except Exception:  # noqa: BLE001 (what the interpreter would print and exit 1 with)
                traceback.print_exc()
                code = 1
    finally:
        os.chdir(saved_cwd)
        sys.argv[:], sys.path[:] = saved_argv, saved_path
        os.environ.clear()
        os.environ.update(saved_env)
        for s, handler in saved_signals.items():
            signal.signal(s, handler)
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
        for name, disabled in saved_disabled.items():
            logging.getLogger(name).disabled = disabled
        for name in set(sys.modules) - saved_modules:
            if _users_module(getattr(sys.modules[name], "__file__", None), cwd):
                del sys.modules[name]
        if (torch := sys.modules.get("torch")) is not None and saved_threads is not None:
            torch.set_num_threads(saved_threads)
        if not had_groups:
            release_vllm_groups()
    return CliResult(code, out.getvalue(), err.getvalue())


def _users_module(where: str | None, cwd: Path) -> bool:
    """A module file of the user's folder `cwd` (a reward file), not of the repo or the environment (a venv may
    lie in the repo: `make install` puts .venv there)."""
    if not where:
        return False
    path = Path(where).resolve()
    return (path.is_relative_to(cwd) and not path.is_relative_to(REPO)
            and not path.is_relative_to(Path(sys.prefix).resolve()))


def one_line_error(result: CliResult | subprocess.CompletedProcess, code: int = 2) -> str:
    """The one `error:` line of a command that stopped with exit `code` and no traceback."""
    got, err = result.returncode, result.stderr
    assert got == code, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    lines = [line for line in err.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err[-2000:]
    return lines[0]


def stopped(result: CliResult) -> tuple[int, str]:
    """(exit code, stderr) of a command that stopped with an error of ours: never a traceback."""
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    return result.returncode, result.stderr


def grpo_process(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: int = 300
                 ) -> subprocess.CompletedProcess:
    """`python -m grpo_cli ARGS...` in a child process: for the tests whose subject is the process itself."""
    env = {k: v for k, v in (env or os.environ).items() if k != "HYDRA_FULL_ERROR"}
    return subprocess.run([sys.executable, "-m", "grpo_cli", *args], cwd=cwd or REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


# ---- config composition -------------------------------------------------------------------------------------------

def parse_each_yaml_text_once() -> None:
    """OmegaConf.load parses a YAML text once per test process and builds each later load's config from that parse.

    The product composes its config once or twice a process; the suite composes ~770 times (every run_cli, every
    tiny_cfg) and re-parsed the same conf/ and recipes/ files each time in pure-Python YAML, ~40% of a compose. A
    load's result is the same config (OmegaConf.create of the same parsed containers, as OmegaConf.load builds it);
    the key is the text itself, so an edited or new file is parsed anew, and a text that fails to parse raises as
    before (nothing is kept for it). Measured: `compose("train", ["model=tiny"])` 0.21 -> 0.12 s; one `make test`
    loads a configuration 766 times (Hydra's load_configuration, counted)."""
    from omegaconf import OmegaConf

    load = OmegaConf.load
    if getattr(load, "parses_once", False):
        return
    parsed: dict[str, object] = {}

    def cached(file_):
        if isinstance(file_, (str, Path)):
            text = Path(os.path.abspath(file_)).read_text(encoding="utf-8")
        elif callable(getattr(file_, "read", None)):
            text = file_.read()
        else:
            return load(file_)
        if text not in parsed:
            parsed[text] = OmegaConf.to_container(load(io.StringIO(text)))  # no resolving: "${..}" and ??? stay
        return OmegaConf.create(copy.deepcopy(parsed[text]))

    cached.parses_once, cached.original = True, load
    OmegaConf.load = staticmethod(cached)


