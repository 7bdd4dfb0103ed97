"""The Hydra app runtime that every command runs in: recipes, the run folder, one-line errors.

Only the command modules (grpo_cli/commands/) import this module. `hydra_app(NAME)` wraps a
command's `main` in a Hydra main over conf/NAME.yaml: the command line's overrides are composed
once before Hydra does (so a bad override is one `error:` line), torchrun ranks agree on one run
folder, and our errors end in one line each with the exit codes the README lists.
"""

from __future__ import annotations

import difflib
import functools
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from grpo_cli.config import compose, register_recipes
from grpo_cli.distributed import close_world, init_world, start_time, world_size
from grpo_cli.errors import ConfigError, RunError
from grpo_cli.resources import CONF_DIR
from grpo_cli.runs import enclosing_run, nested_error, taken_error


def hydra_app(config_name: str) -> Callable:
    """Decorator: a Hydra main over conf/CONFIG_NAME.yaml whose errors end in one line each, no traceback.

    ConfigError (a setting, an input file): exit 2. RunError and OSError (disk full, a read-only
    folder): exit 1. Ctrl-C outside the training loop's own handler (during a model load): exit 130.
    """
    register_recipes()

    def wrap(fn: Callable[[DictConfig], Any]) -> Callable:
        @functools.wraps(fn)
        def task(cfg: DictConfig) -> Any:
            try:
                return fn(cfg)
            except ConfigError as err:
                if os.environ.get("HYDRA_FULL_ERROR") == "1":
                    raise
                for line in str(err).splitlines():  # validate() reports every problem, one per line
                    print(f"error: {line}", file=sys.stderr)
                sys.exit(2)
            except (RunError, OSError) as err:
                if os.environ.get("HYDRA_FULL_ERROR") == "1":
                    raise
                print(f"error: {err}", file=sys.stderr)
                sys.exit(1)
            except KeyboardInterrupt:
                print("interrupted", file=sys.stderr)
                sys.exit(130)
            except Exception as err:
                # a Ctrl-C inside a lazy import comes back as transformers' ModuleNotFoundError
                if _caused_by_interrupt(err) and os.environ.get("HYDRA_FULL_ERROR") != "1":
                    print("interrupted", file=sys.stderr)
                    sys.exit(130)
                raise

        app = hydra.main(version_base=None, config_path=str(CONF_DIR), config_name=config_name)(task)

        @functools.wraps(fn)
        def entry() -> Any:
            _precompose(config_name, sys.argv[1:])
            sys.argv += rank_overrides(config_name, sys.argv[1:])
            _check_output_dir(sys.argv[1:])
            _check_not_in_a_run(config_name, sys.argv[1:])
            result = app()
            close_world()  # ended normally: leave torchrun's process group before the interpreter exits
            return result

        return entry

    return wrap


def rank_overrides(config_name: str, argv: list[str]) -> list[str]:
    """Overrides that make N ranks (torchrun) one run: every rank's run folder is the one rank 0's clock
    names (Hydra's ${now:} is read on each rank), and only rank 0 writes Hydra's .hydra/ and log file."""
    if world_size() == 1:
        return []
    world = init_world()
    extra = []
    if not any(arg.startswith("hydra.run.dir=") for arg in argv):
        extra.append("hydra.run.dir=" + _default_run_dir(config_name))
    if not world.main:
        extra += ["hydra.output_subdir=null", "hydra/job_logging=disabled"]
    return extra


def _default_run_dir(config_name: str) -> str:
    """conf/CONFIG_NAME.yaml's hydra.run.dir with ${now:...} read from rank 0's start time."""
    hydra_node = OmegaConf.load(CONF_DIR / f"{config_name}.yaml").hydra
    pattern = OmegaConf.to_container(hydra_node.run, resolve=False)["dir"]
    when = start_time()
    return re.sub(r"\$\{now:([^}]*)\}", lambda m: when.strftime(m.group(1)), pattern)


def _check_not_in_a_run(config_name: str, argv: list[str]) -> None:
    """A command's folder may not lie inside a training run's folder: that run's keep_last would delete it
    (RUN/checkpoints/step_N/), and Hydra would rewrite the run's .hydra/ records before our code runs.
    Only `grpo train resume=` may name a run folder itself (the run goes on in its own folder)."""
    if any(a in ("-m", "--multirun") for a in argv):
        return
    given = [a.split("=", 1)[1] for a in argv if a.startswith("hydra.run.dir=")]
    folder = Path(given[-1] if given else _default_run_dir(config_name))
    resuming = config_name == "train" and any(a.startswith("resume=") and a != "resume=null" for a in argv)
    outer = enclosing_run(folder, itself=not resuming)
    if outer is not None:
        same = config_name == "train" and outer == folder.absolute()
        print(f"error: {taken_error(folder) if same else nested_error(folder, outer)}", file=sys.stderr)
        sys.exit(2)


def _check_output_dir(argv: list[str]) -> None:
    """Hydra creates the run folder before any of our code runs; a folder it cannot create (a
    read-only file system, no permission) would end in its traceback, so check first."""
    sweep = any(a in ("-m", "--multirun") for a in argv)
    key = "hydra.sweep.dir=" if sweep else "hydra.run.dir="
    given = [a.split("=", 1)[1] for a in argv if a.startswith(key)]
    folder = Path(given[-1] if given else ("multirun" if sweep else "outputs")).absolute()
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not os.access(existing, os.W_OK):
        print(f"error: cannot write the run folder {folder} ({existing} is read-only or not writable); "
              f"choose another: {key}...", file=sys.stderr)
        sys.exit(2)


def _caused_by_interrupt(err: BaseException) -> bool:
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, KeyboardInterrupt):
            return True
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return False


def _precompose(config_name: str, argv: list[str]) -> None:
    """Compose the command line's overrides once before Hydra does, so that an override Hydra cannot
    apply (`trainer.foo=1`, `+recipe=nope`) ends in one `error:` line, exit 2, not Hydra's report.

    Skipped for sweeps (-m) and Hydra's own flags (--help, --cfg, ...), which Hydra handles itself.
    """
    if any(a.startswith("-") for a in argv) or os.environ.get("HYDRA_FULL_ERROR") == "1":
        return
    try:
        compose(config_name, [a for a in argv if not a.startswith("hydra.")])
    except Exception as err:  # Hydra's ConfigCompositionException, OverrideParseException, ...
        text = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
        text = text.split(" Config search path:")[0]
        unknown = re.match(r"Could not override '([^']+)'", text)
        if unknown:
            key = unknown.group(1)
            keys = _flat_keys(compose(config_name))
            close = difflib.get_close_matches(key, keys, n=1)
            text = f"{key} is not a setting; " + (f"did you mean {close[0]}?" if close
                                                     else "`--cfg job` lists the settings")
        print(f"error: {text[:400]}", file=sys.stderr)
        sys.exit(2)


def _flat_keys(node: Any, prefix: str = "") -> list[str]:
    """Dotted paths of every leaf of a config node."""
    if isinstance(node, DictConfig):
        return [k for key in node for k in _flat_keys(node._get_node(key), f"{prefix}{key}.")]
    return [prefix[:-1]]


def command_line_overrides() -> list[str]:
    """The task overrides of the running Hydra job ([] outside one)."""
    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []

