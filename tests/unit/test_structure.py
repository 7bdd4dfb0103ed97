"""The house's one direction (../shared/STYLE.md): the import graph of grpo_cli, read with `ast`.

Function-level imports count as edges: a circle held apart by an import inside a function is still a
circle. The only imports allowed inside functions are of optional packages, each behind its own
availability check (vLLM, the trackers, plotting, `datasets`/parquet readers).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

from tests.helpers import REPO

PACKAGE = REPO / "grpo_cli"

# packages a user may not have installed; only these may be imported inside a function
OPTIONAL = ("vllm", "wandb", "trackio", "mlflow", "tensorboard", "torch.utils.tensorboard", "matplotlib", "datasets",
            "pyarrow", "flash_attn", "bitsandbytes")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


@functools.cache
def parsed(source: str) -> ast.Module:
    """`source`'s syntax tree, parsed once per test process: each test reads the whole package (keyed by the text, so
    an edited module is parsed anew; nothing here changes a tree)."""
    return ast.parse(source)


def imports(path: Path, known: set[str]) -> list[tuple[str, bool, int]]:
    """(imported module, inside a function?, line) for each import of `path`, grpo_cli or not.

    `from grpo_cli.x import y` counts as importing grpo_cli.x.y when that is a module, else grpo_cli.x.
    """
    tree = parsed(path.read_text())
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    in_function = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for n in ast.walk(f)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: climb level - 1 packages up from this one
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        out.extend((t, id(node) in in_function, node.lineno) for t in targets)
    return out


def graph() -> dict[str, set[str]]:
    """{module: the grpo_cli modules it imports}, worked out once per test process for the package's current text
    (eleven tests read it); each caller gets its own sets."""
    edges = _graph(tuple((str(path), path.read_text()) for path in modules().values()))
    return {name: set(targets) for name, targets in edges.items()}


@functools.cache
def _graph(sources: tuple[tuple[str, str], ...]) -> dict[str, set[str]]:
    # `sources` (each module's path and text) is the cache's key: an edited package is read anew
    known = set(modules())
    edges: dict[str, set[str]] = {}
    for name, path in modules().items():
        targets = set()
        for target, _, _ in imports(path, known):
            while target not in known and "." in target:  # grpo_cli.x.some_function -> grpo_cli.x
                target = target.rpartition(".")[0]
            if target in known and target != name and not name.startswith(target + "."):
                targets.add(target)
        edges[name] = targets
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None (depth-first search with colours)."""
    colour = dict.fromkeys(edges, 0)  # 0 unseen, 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        colour[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if colour.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if colour.get(nxt) == 0:
                found = visit(nxt)
                if found:
                    return found
        colour[node] = 2
        path.pop()
        return None

    for start in sorted(edges):
        if colour[start] == 0:
            found = visit(start)
            if found:
                return found
    return None


def test_find_cycle_sees_a_circle_through_three_modules():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_package_has_no_import_circle():
    cycle = find_cycle(graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_function_level_imports_name_optional_packages_only():
    known = set(modules())
    offenders = [f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}"
                 for name, path in modules().items() for target, inside, line in imports(path, known)
                 if inside and not any(target == o or target.startswith(o + ".") for o in OPTIONAL)]
    assert not offenders, "move these imports to the top of their module:\n" + "\n".join(offenders)


def test_commands_never_import_each_other_and_only_commands_import_the_app():
    edges = graph()
    commands = {m for m in edges if m.startswith("grpo_cli.commands.")}
    for name, targets in edges.items():
        if name in commands:
            assert not (targets & commands), f"{name} imports another command: {sorted(targets & commands)}"
        elif name not in ("grpo_cli.cli", "grpo_cli.commands"):
            assert "grpo_cli.app" not in targets, f"{name} imports grpo_cli.app, which only commands may"
            assert not (targets & commands), f"library module {name} imports a command: {sorted(targets & commands)}"


@pytest.mark.parametrize("leaf", ["grpo_cli.errors", "grpo_cli.checks", "grpo_cli.files", "grpo_cli.instantiate",
                                  "grpo_cli.resources", "grpo_cli.objective", "grpo_cli.kernels",
                                  "grpo_cli.user_code", "grpo_cli.records"])
def test_the_ground_floor_imports_nothing_above_it(leaf):
    # a package on the ground floor (objective/) counts as one: its modules may import each other
    edges = graph()
    members = {m for m in edges if m == leaf or m.startswith(leaf + ".")}
    outside = set().union(*(edges[m] for m in members)) - members
    # user_code: where build() finds the user's own `_target_` modules
    user_code = {"grpo_cli.user_code"} if leaf == "grpo_cli.instantiate" else set()
    allowed = {"grpo_cli.errors", "grpo_cli.checks", *user_code} - {leaf}
    assert outside <= allowed, f"{leaf} imports {sorted(outside - allowed)}"


def test_rooms_stay_small_and_the_loop_fits_on_a_screen():
    """No module over 550 lines, no function body over 80, and `grpo train`'s loop at most 40 (issue #39's limits:
    past them a module holds more than one job, or a function more than one step)."""
    big, long, loop = [], [], None
    for path in modules().values():
        source = path.read_text()
        where = path.relative_to(PACKAGE.parent)
        if len(source.splitlines()) > 550:
            big.append(f"{where}: {len(source.splitlines())} lines")
        for node in ast.walk(parsed(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > 80:
                    long.append(f"{where}:{node.lineno} {node.name}: {length} lines")
                if path.name == "train.py" and path.parent.name == "commands" and node.name == "train":
                    loop = length
    assert not big and not long, "split these:\n" + "\n".join(big + long)
    assert loop is not None and loop <= 40, f"commands/train.py's train() is {loop} lines"
