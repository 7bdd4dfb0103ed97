"""The user's own modules: imported from the working folder only when a setting names them.

The working folder is not on `sys.path` (grpo_cli/cli.py takes it off): a `json.py` or `statistics.py`
lying there would otherwise stand in for the library module of that name in torch, transformers and
everything else imported after it. A module the user names (`reward.funcs=[my_rewards.fn]`, a
`_target_` of their own, a tool module) is resolved here instead, after the libraries are imported:

- a module that is installed (or in the standard library) and not in the working folder: imported as usual;
- a module found only in the working folder: imported from there, the folder at the end of `sys.path` for
  that import alone, so its own imports of files beside it work and a library still wins over such a file;
- a module in the working folder whose name an installed module also has: refused with one line (rename
  it), since either choice would surprise someone (`reward.funcs=[json.fn]` meaning the user's json.py).

`import_file` runs a file named by path (`path/to/rewards.py:fn`) under a module name of its own, and
`load_function` resolves the function a setting names (`module.fn`, `path/to/file.py:fn` or a short name the caller
gives): reward functions, tools and environment classes all resolve through it.
The ground floor: imports nothing of grpo_cli but errors, so instantiate.build can resolve `_target_`s.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from grpo_cli.errors import ConfigError

# path/to/file.py -> its module, executed once per file and process
_FILES: dict[Path, ModuleType] = {}


@contextlib.contextmanager
def folder_last(folder: Path) -> Iterator[None]:
    """`folder` at the end of sys.path while the block runs: found only where no installed module is."""
    entry = str(folder)
    added = entry not in sys.path
    if added:
        sys.path.append(entry)
        importlib.invalidate_caches()  # a file written since the last import is seen
    try:
        yield
    finally:
        if added and entry in sys.path:
            sys.path.remove(entry)


def _local(folder: Path, top: str) -> Path | None:
    """The working folder's module `top`: top.py or a package top/__init__.py; None when there is none."""
    for path in (folder / f"{top}.py", folder / top / "__init__.py"):
        if path.is_file():
            return path
    return None


def local_module(top: str) -> Path | None:
    """The working folder's own module `top` (top.py or top/__init__.py), where `import_module` would look for the
    user's module of that name; None when the folder has none."""
    return _local(Path.cwd().resolve(), top)


def _installed(top: str, folder: Path) -> str | None:
    """Where module `top` comes from without the working folder (a file, or "built-in"); None: nowhere."""
    if top in sys.builtin_module_names:
        return "built-in"
    module = sys.modules.get(top)
    if module is not None:
        return getattr(module, "__file__", None) or next(iter(getattr(module, "__path__", [])), "built-in")
    saved = sys.path[:]
    sys.path[:] = [p for p in saved if Path(p or ".").resolve() != folder]
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        spec = None
    finally:
        sys.path[:] = saved
    if spec is None:
        return None
    return spec.origin or next(iter(spec.submodule_search_locations or []), "built-in")


def _resolve(name: str, where: str) -> bool:
    """Whether module `name` is to be imported from the working folder; ConfigError when the folder's file of that
    name would shadow an installed module."""
    folder = Path.cwd().resolve()
    top = name.partition(".")[0]
    local = _local(folder, top)
    if local is None:
        return False
    origin = _installed(top, folder)
    if origin is None:
        return True
    if origin != "built-in" and Path(origin).resolve().is_relative_to(folder):
        return False  # the installed module is the folder's own (a checkout run from its root, PYTHONPATH=.)
    raise ConfigError(f"{where}: {local.relative_to(folder)} in the working folder ({folder}) has the name of the "
                      f"installed module {top!r} ({origin}); rename it (e.g. my_{top}.py) and use the new name "
                      f"in {where}")


def import_module(name: str, where: str) -> ModuleType:
    """`importlib.import_module(name)`, the working folder searched last and only for the user's own module."""
    if _resolve(name, where):
        with folder_last(Path.cwd().resolve()):
            return importlib.import_module(name)
    return importlib.import_module(name)


def import_file(file: Path, where: str) -> ModuleType:
    """The module of the file `path/to/file.py`, executed once per process under a name of its own (two files
    called rewards.py do not replace each other); its folder is searched last while it runs."""
    path = file.expanduser().resolve()
    if path in _FILES:
        return _FILES[path]
    if not path.is_file():
        raise ConfigError(f"{where}: {file} does not exist (looked in {Path.cwd()}); give a path to a .py file "
                          f"(relative to the working directory) before :function")
    name = f"grpo_user_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up here
    try:
        with folder_last(path.parent):
            spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise ConfigError(f"{where}: running {file} raised {type(err).__name__}: {err}; fix the file") from None
    _FILES[path] = module
    return module


def _targets(node: Any, key: str) -> Iterator[tuple[str, str]]:
    """(dotted key, `_target_` value) of every node under `node` (plain containers)."""
    if isinstance(node, dict):
        target = node.get("_target_")
        if isinstance(target, str) and "${" not in target:
            yield f"{key}._target_" if key else "_target_", target
        for k, v in node.items():
            yield from _targets(v, f"{key}.{k}" if key else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _targets(v, f"{key}[{i}]")


def import_targets(node: Any, where: str = "") -> None:
    """Import, from the working folder, the user's modules that `_target_`s under `node` (a plain container) name
    and no installed module provides (`model.loader._target_=my_loader.load`), so that Hydra finds them."""
    for key, target in _targets(node, where):
        top = target.partition(".")[0]
        folder = Path.cwd().resolve()
        if top in sys.modules or _local(folder, top) is None or _installed(top, folder) is not None:
            continue
        try:
            with folder_last(folder):
                importlib.import_module(top)
        except Exception as err:
            raise ConfigError(f"{key} ({target}): importing {top} from the working folder raised "
                              f"{type(err).__name__}: {err}; fix the module") from None


# ---- a function a setting names -------------------------------------------------------------------------------

def _search_path() -> str:
    return ", ".join(p or "." for p in sys.path)


def _import_dotted(spec: str, where: str) -> tuple[Any, list[str]]:
    """(the longest importable module prefix of `spec`, the attribute names after it)."""
    parts = spec.split(".")
    for i in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:i])
        try:
            return import_module(module, where), parts[i:]
        except ModuleNotFoundError as err:
            if err.name is not None and (module == err.name or module.startswith(err.name + ".")):
                continue  # this prefix is not a module: try a shorter one (module.Class.method)
            raise ConfigError(f"{where}: importing {module} raised ModuleNotFoundError: {err}; install that "
                              f"package or fix the import") from None
        except Exception as err:
            raise ConfigError(f"{where}: importing {module} raised {type(err).__name__}: {err}; fix the module"
                              ) from None
    raise ConfigError(f"{where}: no module named {parts[0]!r} in the working folder ({Path.cwd()}) or on sys.path "
                      f"({_search_path()}); put {parts[0]}.py in the working folder, or give a file: "
                      f"path/to/{parts[0]}.py:{parts[-1]}")


def load_function(spec: Any, where: str, builtins: Mapping[str, Callable] | None = None) -> tuple[str, Callable]:
    """(its name, the callable) a setting names: `module.fn`, `path/to/file.py:fn`, or a key of `builtins` (the
    caller's short names, e.g. the built-in reward functions). `where` is the setting, for the error lines."""
    builtins = builtins or {}
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"{where} ({spec!r}) must be a name: module.function, path/to/file.py:function or a "
                          f"built-in ({', '.join(builtins)})")
    spec = spec.strip()
    if spec in builtins:
        return spec, builtins[spec]
    if ":" in spec:
        file, _, attr = spec.rpartition(":")
        owner, names, shown = import_file(Path(file), where), attr.split("."), file
    elif "." in spec:
        owner, names = _import_dotted(spec, where)
        shown = owner.__name__
    else:
        raise ConfigError(f"{where} ({spec}) is not a built-in ({', '.join(builtins)}); name your function as "
                          f"module.function or path/to/file.py:function")
    obj = owner
    for name in names:
        if not hasattr(obj, name):
            defined = sorted(k for k, v in vars(owner).items() if callable(v) and not k.startswith("_")
                             and getattr(v, "__module__", None) == owner.__name__)
            raise ConfigError(f"{where}: {shown} has no {name!r} (its functions: {', '.join(defined) or 'none'}); "
                              f"fix the name in reward.funcs")
        obj = getattr(obj, name)
    if not callable(obj):
        raise ConfigError(f"{where}: {spec} is a {type(obj).__name__}, not a function")
    return getattr(obj, "__name__", names[-1]), obj
