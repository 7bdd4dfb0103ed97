"""Run folders: who owns one, and what a resumed run keeps.

A run folder (`outputs/train/DATE/TIME`, or `hydra.run.dir`) holds one run: `metrics.jsonl`,
`completions.jsonl`, `checkpoints/step_N/`. `claim()` makes one process its owner for as long as
it trains (an advisory lock on RUN/.lock: a second `grpo train` on the same folder stops with the
owner's pid), and refuses a fresh run in a folder that already holds one, since starting over
would truncate its metrics under its old checkpoints. `enclosing_run()` finds a run around a folder:
no command writes inside another run (its `keep_last` would delete a folder in `checkpoints/`, and
its records would be rewritten), so app.py refuses such a folder before Hydra creates it.

`resume_config()` is the one place that says what a resumed run may change: only settings that
cannot change the math (how long to train, how often to save and log, where to report). Anything
else it refuses with a line naming the key, so `grpo train resume=RUN` never continues a run with
another model, group size or learning rate than it was trained with.

`upgrade()` is the one place that reads a run saved before some of today's keys existed: each key its config lacks
takes the value of the YAML of the group option the run was composed from (`conf/GROUP/OPTION.yaml`, as a command
composes it), so no other module keeps a default of its own for old runs. Every command that reads a run folder gets
its config through it (`read_saved`).

A saved config is data, not code (`check_saved`): what eval, sample, resume, export and rm read back from a run
folder may build only the components grpo_cli ships (the `_target_`s that conf/ and recipes/ name), unless the
user trusts the run (`trust_run_config=true`) or gives the node on the command line; the reward files it names
are said before they run (docs/runs.md, "A run folder is data"). `anchored()` makes a run's relative paths
absolute against the folder it started in, so a run is resumed and evaluated from any folder.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
from collections.abc import Iterator
from pathlib import Path

from antlr4 import ParserRuleContext  # the runtime of OmegaConf's parser: its interpolation grammar's trees
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.grammar.gen.OmegaConfGrammarParser import OmegaConfGrammarParser as Grammar
from omegaconf.grammar_parser import parse

from grpo_cli import checkpoint, files, user_code
from grpo_cli.algo import upgrade_loss_node
from grpo_cli.config import compose
from grpo_cli.errors import ConfigError
from grpo_cli.metrics.console import console
from grpo_cli.options import TRAIN_YAML, groups, missing_keys, option, option_of, read_yaml
from grpo_cli.resources import CONF_DIR, RECIPES_DIR

# settings a resumed run may change; everything else comes from the run's saved config
RESUMABLE = ("resume", "trainer.max_steps", "trainer.save_every", "trainer.keep_last", "trainer.report_to",
             "trainer.project", "trainer.log_completions_every", "trainer.num_completions_to_print",
             "trainer.completions_max_mb", "trainer.max_nonfinite_steps",
             # how the base is held across ranks, not what is computed (tests/unit/test_fsdp.py: the same weights)
             "trainer.fsdp",
             # how the update's decoder runs (compiled or eager), not what it computes (float rounding aside)
             "trainer.compile",
             # whether this command trusts the code a run folder's config names (check_saved): not the run's math
             "trust_run_config")


# sections of plain settings, all of them grpo_cli's: a key missing at any depth is newer than the run (`upgrade`), and
# one the command line gives on resume takes its value (`resume_config`). In the other sections only a key of the
# section itself is newer than the run: one missing deeper (a reward function, a tool) is the run's own choice
PLAIN = ("trainer", "iterative", "rm")


class RunLock:
    """An exclusive advisory lock on RUN/.lock, held until `release()` or the process ends (even by kill -9)."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / ".lock"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.read(self.fd, 32).decode(errors="replace").strip() or "?"
            os.close(self.fd)
            raise ConfigError(f"{run_dir} is in use by another grpo train (pid {owner}); wait for it to finish "
                              f"or choose another folder: hydra.run.dir=...") from None
        os.ftruncate(self.fd, 0)
        os.write(self.fd, str(os.getpid()).encode())

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def holds_a_run(run_dir: Path) -> bool:
    """Metrics or checkpoints from an earlier run are in this folder."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    return (metrics.exists() and metrics.stat().st_size > 0) or any((run_dir / "checkpoints").glob("step_*"))


def enclosing_run(folder: Path, itself: bool = False) -> Path | None:
    """The run folder that holds `folder`: the nearest parent that holds a run (or `folder` itself, when
    `itself`), or None."""
    folder = Path(folder).absolute()
    for candidate in ((folder,) if itself else ()) + tuple(folder.parents):
        if holds_a_run(candidate):
            return candidate
    return None


def nested_error(folder: Path, run: Path, key: str = "hydra.run.dir") -> str:
    """The line that refuses `folder`, the run folder `run` or a folder inside it."""
    where = "is" if Path(folder).absolute() == run else "is inside"
    return (f"{folder} {where} the run folder {run}: that run owns it (its keep_last deletes old checkpoints/, "
            f"its records would be overwritten); choose a folder outside it: {key}=...")


def taken_error(run_dir: Path) -> str:
    """The line that refuses a fresh run in a folder that holds one."""
    return (f"{run_dir} already holds a run (metrics.jsonl or checkpoints/); continue it with "
            f"resume={run_dir}, or start a new one in another folder: hydra.run.dir=...")


def claim(run_dir: Path, resuming: bool) -> RunLock:
    """Lock `run_dir` for this process; a fresh run may not start in a folder that holds a run, and no run
    starts inside another one."""
    outer = enclosing_run(run_dir)
    if outer is not None:
        raise ConfigError(nested_error(run_dir, outer))
    lock = RunLock(run_dir)
    if not resuming and holds_a_run(run_dir):
        lock.release()
        raise ConfigError(taken_error(run_dir))
    return lock


def _flat(node: DictConfig, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in node.items():
        if isinstance(value, DictConfig):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
    return out


def _resumable(key: str) -> bool:
    return any(key == r or key.startswith(r + ".") for r in RESUMABLE)


def resume_config(cfg: DictConfig, saved: DictConfig, overrides: list[str] | None) -> DictConfig:
    """The config a resumed run goes on with: the run's `saved` config (as it saved it) made whole (`upgrade`), plus
    the allowed changes.

    `overrides` are the command line's (`key=value`, `+key=value`, `group=option`): only those keys
    are compared with the saved run, so `grpo train resume=RUN` alone continues the run as it was.
    None (a library call) compares every key of `cfg`. A changed key that is not RESUMABLE is an
    error naming it; a key of the PLAIN sections that the run lacks (newer than it) takes the command line's value.
    """
    new, old = _flat(OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))), _flat(upgrade_loss_node(saved))
    names = sorted(new) if overrides is None else [o.lstrip("+~").split("=", 1)[0] for o in overrides]
    asked: set[str] = set()
    errors = []
    for name in names:  # one line per override, however many keys a group override changes
        keys = [k for k in new if k == name or k.startswith(name + ".")]
        asked.update(keys)
        changed = [k for k in keys if k in old and new[k] != old[k] and not _resumable(k)]
        if changed:
            more = f" (and {len(changed) - 1} more keys under {name})" if len(changed) > 1 else ""
            key = changed[0]
            errors.append(f"{key} was {old[key]!r} in the run and is {new[key]!r} now{more}: a resumed run keeps its "
                          f"own settings; drop that override (a resume may change only "
                          f"{', '.join(r for r in RESUMABLE if r != 'resume')})")
    if errors:
        raise ConfigError("\n".join(errors))
    merged = upgrade(saved)
    # a key newer than the run (absent from its config) in a PLAIN section, given on the command line, is not a change
    # of the run's setting (a key under a section the run saved as null is not newer: trainer.guard=null was its own)
    newer = {k for k in set(new) - set(old) if k.split(".")[0] in PLAIN
             and not any(".".join(k.split(".")[:i]) in old for i in range(1, k.count(".") + 1))}
    for key in sorted(asked):
        if _resumable(key) or key in newer:
            OmegaConf.update(merged, key, new[key], force_add=True)
    return merged


# ---- a run saved before some of today's keys existed ------------------------------------------------------------

def _newer_keys(plain: dict) -> tuple[dict[str, str], list[str]]:
    """({group: option} the run was composed from, the dotted keys of today's YAML that its config lacks)."""
    choices, missing = {}, []
    for group, default in groups().items():
        if group not in plain:  # a run saved before the group existed: its default, the only option there was then
            choices[group] = default
            missing.append(group)
        elif isinstance(plain[group], dict) and (name := option_of(group, plain[group])) is not None:
            choices[group] = name
            missing += missing_keys(plain[group], option(group, name), f"{group}.", group in PLAIN)
    own = {k: v for k, v in read_yaml(TRAIN_YAML).items() if k not in ("defaults", "hydra")}  # trainer, iterative, ...
    missing += missing_keys(plain, own, "", True)
    return choices, missing


@functools.cache
def _composed(choices: tuple[tuple[str, str], ...]) -> dict:
    """The train config composed with these group options, plain and unresolved (composed once per process)."""
    return OmegaConf.to_container(compose("train", [f"{g}={o}" for g, o in choices]), resolve=False)


def upgrade(saved: DictConfig) -> DictConfig:
    """`saved` (a run's config.yaml) with every key it lacks that today's YAML of its group options holds, at that
    YAML's value as a command composes it (an interpolation, `${model.device}`, reads the run's own value): what a
    run saved before the key existed runs with. Its `algo.loss` node, if it lists the loss settings, names its class
    alone (`algo.upgrade_loss_node`). A config that lacks nothing comes back as it is, without composing anything."""
    saved = upgrade_loss_node(saved)
    plain = OmegaConf.to_container(saved, resolve=False)
    choices, missing = _newer_keys(plain)
    if not missing:
        return saved
    whole = OmegaConf.merge(OmegaConf.create(_composed(tuple(sorted(choices.items())))), saved)
    out = saved.copy()
    with open_dict(out):
        for key in missing:
            value = OmegaConf.select(whole, key, throw_on_missing=False)
            value = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
            if value != "???":  # a value the command line must give (reward.funcs): every run gave one
                OmegaConf.update(out, key, value, force_add=True)
    return out


# ---- a saved config read back: data, not code -------------------------------------------------------------------

@functools.cache
def shipped_targets() -> frozenset[str]:
    """Every `_target_` that conf/ and recipes/ name: the components (and the optimizer) grpo_cli ships."""
    found: set[str] = set()

    def collect(node) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("_target_"), str):
                found.add(node["_target_"])
            for value in node.values():
                collect(value)
        elif isinstance(node, list):
            for value in node:
                collect(value)

    for path in (*sorted(CONF_DIR.rglob("*.yaml")), *sorted(RECIPES_DIR.glob("*.yaml"))):
        collect(OmegaConf.to_container(OmegaConf.load(path), resolve=False))
    return frozenset(found)


# shipped components whose keys name the user's code (a file `path/to/file.py:fn` or a module `module.fn`), which
# the component imports when it is built: reward functions at any depth, an environment's tools and its class
CODE_KEYS = {"grpo_cli.rewards.user.CustomReward": ("funcs",), "grpo_cli.env.ToolsEnv": ("tools",),
             "grpo_cli.env.ClassEnv": ("factory", "tools")}
# the judge reward (rewards/judge.py): where it sends completions, and the environment variable whose value it sends
JUDGE = "grpo_cli.rewards.judge.judge"


def _nodes(node, path: str) -> Iterator[tuple[str, dict]]:
    """(dotted key, node) of every dict under `node` (a plain container), itself included, at any depth."""
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from _nodes(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _nodes(value, f"{path}.{i}")


def _code(node, path: str) -> Iterator[tuple[str, str]]:
    """(dotted key, what it would run) of every node under `node` (a plain container) that names code grpo_cli
    does not ship: a `_target_` outside shipped_targets(), nested in lists and dicts at any depth, or
    trust_remote_code=true."""
    if isinstance(node, dict):
        target = node.get("_target_")
        if target is not None and (not isinstance(target, str) or target not in shipped_targets()):
            yield path, f"{path}._target_ ({target}) is not a grpo_cli component"
            return  # what it holds is refused with it
        for key, value in node.items():
            if key == "trust_remote_code" and value not in (False, None):  # a truthy string turns it on too
                yield f"{path}.{key}", f"{path}.{key} is {value!r} (the model repo's own code would run)"
            else:
                yield from _code(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _code(value, f"{path}.{i}")


def _specs(value) -> list[str]:
    """The code names of a CODE_KEYS value: one string, a list of them, or a mapping to them (env=class's factories
    by name)."""
    if isinstance(value, dict):
        value = list(value.values())
    return [value] if isinstance(value, str) else [str(s) for s in value] if isinstance(value, list) else []


def code_names(node, path: str) -> Iterator[tuple[str, str]]:
    """(dotted key, name) of every user file or module that a shipped component under `node` would import: the
    `path/to/file.py` of `path/to/file.py:fn`, or the module of `module.fn` (a built-in reward's name has no dot)."""
    for where, found in _nodes(node, path):
        target = found.get("_target_")
        for key in CODE_KEYS.get(target, ()) if isinstance(target, str) else ():
            for spec in _specs(found.get(key)):
                name = spec.rpartition(":")[0] if ":" in spec else spec.rpartition(".")[0]
                if name:
                    yield f"{where}.{key}", name


def _inside(name: str, run_dir: Path) -> bool:
    """Whether the file or module `name` (as code_names gives it) would be read from inside `run_dir`: a file
    there, or a module of the working folder (searched for the user's own modules, user_code) that lies there."""
    if name.endswith(".py") or "/" in name:
        return Path(name).expanduser().resolve().is_relative_to(run_dir)
    local = user_code.local_module(name.partition(".")[0])
    return local is not None and local.resolve().is_relative_to(run_dir)


def judges(node, path: str) -> Iterator[tuple[str, dict]]:
    """(dotted key, node) of every judge reward under `node`."""
    return ((where, found) for where, found in _nodes(node, path) if found.get("_target_") == JUDGE)


def _given(path: str, overrides: list[str]) -> bool:
    """The command line gives the node at `path` (or its target, or a section around it) itself."""
    keys = [o.lstrip("+~").split("=", 1)[0] for o in overrides]
    return any(path == k or path.startswith(k + ".") or k == path + "._target_" for k in keys)


def _doors(plain: dict, sections, overrides: list[str], run_dir: Path) -> list[tuple[str, str]]:
    """(key to give, what it would do) of each thing `plain`'s `sections` would run, read or send that the user
    did not choose: code grpo_cli does not ship, a user file inside the run folder, a judge's endpoint or key."""
    found = []
    for section in (s for s in sections if s in plain):
        found += [(path, what) for path, what in _code(plain[section], section) if not _given(path, overrides)]
        # grpo train writes no code into a run folder: a file (or module) there came with the run, not from the user
        found += [(path, f"{path} ({name}) lies inside the run folder, where grpo train writes no code")
                  for path, name in code_names(plain[section], section)
                  if not _given(path, overrides) and _inside(name, run_dir)]
        for path, judge in judges(plain[section], section):
            if not _given(f"{path}.base_url", overrides):
                found.append((f"{path}.base_url", f"{path}.base_url ({judge.get('base_url')}) is the run's: the "
                                                  f"judge would send completions there"))
            if judge.get("api_key_env") and not _given(f"{path}.api_key_env", overrides):
                found.append((f"{path}.api_key_env", f"{path}.api_key_env ({judge.get('api_key_env')}) is the "
                                                     f"run's: the judge would send that variable's value"))
    return found


def check_saved(saved: DictConfig, sections, overrides: list[str], trusted, source: Path) -> None:
    """Refuse (one line) what `saved`'s `sections` would run, read or send that the user did not choose (`_doors`),
    unless `trusted` (trust_run_config=true) or the command line gives that node; then name on the console the
    user files and the judge endpoints of the saved config that will be used. `source`: the checkpoint folder the
    config came from."""
    if not isinstance(trusted, bool):
        raise ConfigError(f"trust_run_config ({trusted!r}) must be true or false; set trust_run_config=false")
    plain = OmegaConf.to_container(saved, resolve=False)
    source = Path(source).absolute()
    run_dir = (source.parent.parent if source.parent.name == "checkpoints" else source).resolve()
    found = [] if trusted else _doors(plain, sections, overrides, run_dir)
    if found:
        path, what = found[0]
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise ConfigError(f"{source}/config.yaml would run code that is not grpo_cli's: {what}{more}; a run folder's "
                          f"config is data: it builds only grpo_cli's own components (conf/, recipes/) and runs, "
                          f"reads or sends nothing you did not choose. If you trust this run, pass "
                          f"trust_run_config=true, or give it yourself: {path}=...")
    for section in (s for s in sections if s in plain):
        named = {}
        for path, name in code_names(plain[section], section):
            if not _given(path, overrides):
                named.setdefault(name, path)
        for name, path in named.items():
            what = "reward functions" if path.startswith("reward") else "tools" if path.endswith("tools") else \
                "the environment" if path.endswith("factory") else "code"
            shown = name if name.endswith(".py") or "/" in name else f"module {name}"
            _say(f"{what} from {shown} (saved with the run)")
        for path, judge in judges(plain[section], section):
            key = judge.get("api_key_env")
            _say(f"judge {path}: completions go to {judge.get('base_url')}"
                 + (f" with the key in ${key}" if key else "") + " (saved with the run)")


def _say(line: str) -> None:
    console.print(line, markup=False, highlight=False, soft_wrap=True)


# the run's copy of data.chat_template's text, in its folder: its resume and its eval render the prompts it trained on
# even when the user's file changes or moves (a template is rendered by transformers' sandboxed Jinja: data, not code)
TEMPLATE_FILE = "chat_template.jinja"


def keep_chat_template(cfg: DictConfig, run_dir: Path, text: str | None, writes: bool) -> DictConfig:
    """`cfg` whose data.chat_template names the run's copy of the template's `text` (written when `writes`: rank 0),
    relative to the run folder, where `read_saved` finds it; `cfg` itself without a template."""
    if text is None:
        return cfg
    if writes:
        files.write_text(Path(run_dir) / TEMPLATE_FILE, text)
    cfg = cfg.copy()
    OmegaConf.update(cfg, "data.chat_template", TEMPLATE_FILE)
    return cfg


def _interpolations(text: str) -> tuple[list[str], bool]:
    """(the resolvers an OmegaConf string calls, whether it interpolates at all), from OmegaConf's own grammar: what
    OmegaConf would run when the value is read."""
    resolvers, interpolates = [], False

    def walk(tree) -> None:
        nonlocal interpolates
        if isinstance(tree, Grammar.InterpolationResolverContext):
            resolvers.append(tree.resolverName().getText())
        interpolates |= isinstance(tree, (Grammar.InterpolationResolverContext, Grammar.InterpolationNodeContext))
        for i in range(tree.getChildCount() if isinstance(tree, ParserRuleContext) else 0):
            walk(tree.getChild(i))

    walk(parse(text))
    return resolvers, interpolates


def _strings(node, path: str) -> Iterator[tuple[str, str]]:
    """(dotted key, text) of every string under `node` (a plain container), its dict keys included."""
    if isinstance(node, dict):
        for key, value in node.items():
            if isinstance(key, str):
                yield f"{path}.{key}".lstrip("."), key
            yield from _strings(value, f"{path}.{key}".lstrip("."))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _strings(value, f"{path}.{i}".lstrip("."))
    elif isinstance(node, str):
        yield path, node


def _refuse_interpolation(file: Path, path: str, what: str) -> ConfigError:
    return ConfigError(f"{file} would run code that is not grpo_cli's: {path} {what}, which grpo train never "
                       f"saves (it saves its config resolved); a run folder's config is data. If you trust this "
                       f"run, pass trust_run_config=true, or give it yourself: {path}=...")


def resolved(saved: DictConfig, file: Path) -> DictConfig:
    """`saved` with its interpolations resolved before any check reads it, so the checks see what would be built.

    A plain reference (`${model.name}`) is resolved. A resolver (`${oc.create:...}` builds a node with any
    `_target_` from text, `${oc.env:VAR}` reads a secret into a value the run may send, and any other is code) is
    refused, and so is a value that still interpolates once resolved (an escaped one, revived)."""
    for path, text in _strings(OmegaConf.to_container(saved, resolve=False), ""):
        if "${" not in text:
            continue
        try:
            resolvers, _ = _interpolations(text)
        except Exception:  # OmegaConf's GrammarParseError: the value would fail when read anyway
            raise _refuse_interpolation(file, path, f"({text[:80]!r}) is not a value OmegaConf can read") from None
        if resolvers:
            raise _refuse_interpolation(file, path, f"calls the resolver {resolvers[0]}")
    try:
        plain = OmegaConf.to_container(saved, resolve=True)
    except Exception as err:  # a reference to a missing key, or a loop
        raise ConfigError(f"{file} cannot be read ({str(err).splitlines()[0][:200]}); "
                          f"use an earlier checkpoint") from None
    for path, text in _strings(plain, ""):
        if "${" in text and _interpolations(text)[1]:
            raise _refuse_interpolation(file, path, "resolves to another interpolation")
    return OmegaConf.create(plain)


def read_saved(ckpt: Path, sections, overrides: list[str] | None, trusted, upgraded: bool = True) -> DictConfig:
    """Checkpoint `ckpt`'s config.yaml read as data: no alias expanded (checkpoint.load_config), its interpolations
    resolved without resolvers (`resolved`), its relative paths anchored in the folder the run started in
    (trainer_state.json's `started_in`), its `sections` (None: all) checked by check_saved, and the keys it lacks
    filled (`upgrade`; not when `upgraded` is false: resume_config reads the run's own keys, then upgrades)."""
    ckpt = Path(ckpt)
    saved = checkpoint.load_config(ckpt)
    if trusted is not True:  # before anything reads a value: reading one resolves it
        saved = resolved(saved, ckpt / "config.yaml")
    if OmegaConf.select(saved, "data.chat_template", default=None) == TEMPLATE_FILE:  # the run's own copy
        OmegaConf.update(saved, "data.chat_template", str((ckpt.parent.parent / TEMPLATE_FILE).resolve()))
    state = json.loads((ckpt / "trainer_state.json").read_text())
    if isinstance(state, dict) and isinstance(state.get("started_in"), str):
        saved = anchored(saved, Path(state["started_in"]))
    check_saved(saved, list(saved) if sections is None else sections, overrides or [], trusted, ckpt)
    return upgrade(saved) if upgraded else saved


# keys that hold a file or folder; a relative one is read against the folder the run started in
PATH_KEYS = ("data.path", "model.name_or_path", "model.loader.name_or_path", "model.init_adapter",
             "reward.name_or_path", "rm.init", "rm.labeled", "rm.replay.folder")


def anchored(cfg: DictConfig, folder: Path) -> DictConfig:
    """`cfg` with its relative paths that exist under `folder` made absolute (a hub id stays as it is), and the
    files of reward.funcs (`path/file.py:fn`) too: the run reads the same files from any working folder."""
    cfg = cfg.copy()
    folder = Path(folder)
    for key in PATH_KEYS:
        value = OmegaConf.select(cfg, key, default=None)
        if isinstance(value, str) and value and not Path(value).expanduser().is_absolute() \
                and (folder / value).exists():
            OmegaConf.update(cfg, key, str((folder / value).resolve()))
    funcs = OmegaConf.select(cfg, "reward.funcs", default=None)
    if isinstance(funcs, (str, ListConfig)):
        specs = [funcs] if isinstance(funcs, str) else list(funcs)
        for i, spec in enumerate(specs):
            file, colon, fn = str(spec).rpartition(":")
            if colon and not Path(file).expanduser().is_absolute() and (folder / file).is_file():
                specs[i] = f"{(folder / file).resolve()}:{fn}"
        cfg.reward.funcs = specs[0] if isinstance(funcs, str) else specs
    return cfg
