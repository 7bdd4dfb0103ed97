"""The suite's own layout (docs/development.md, The test suite): test modules share helpers through tests/helpers/
and conftest.py, never by importing each other."""

from __future__ import annotations

import ast

from tests.helpers import REPO

TESTS = REPO / "tests"


def test_no_test_module_imports_another():
    found = []
    for path in sorted(TESTS.rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(REPO)} imports {n}" for n in names
                      if n.split(".")[-1].startswith("test_") or n.startswith(("tests.unit", "tests.integration",
                                                                                 "tests.system"))]
    assert found == []


def test_test_modules_have_unique_names():
    """pytest imports test files by their base name (no __init__.py in the tiers): two of one name stop collection."""
    names = [p.name for p in TESTS.rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []
