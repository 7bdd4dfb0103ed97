"""A script of scripts/ loaded as a module, as running it loads it: its folder first on sys.path while it loads (a
script imports its siblings by name: paired, staleness_probe, server_check), and the module in sys.modules under its
name (dataclasses look their module up there). The siblings it imported stay in sys.modules, as in the script."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from tests.helpers import REPO


def load_script(name: str) -> ModuleType:
    """scripts/NAME.py, executed once per call."""
    folder = str(REPO / "scripts")
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(folder)
    return module
