"""Every setting's home is its YAML line under conf/ with a comment above it (docs/development.md, "Where a
setting lives"): a key without one fails here, naming the file and line."""

from __future__ import annotations

import re

from tests.helpers import REPO

KEY = re.compile(r"^(?P<indent>\s*)(?P<key>[A-Za-z_][\w.]*)\s*:\s*(?P<value>.*)$")
# an argument of a `_target_` node handed on from its section (`beta: ${..beta}`): its home is the key it names
HANDED_ON = re.compile(r"\$\{\.\.[\w.]+\}")


def uncommented(text: str) -> list[tuple[int, str]]:
    """(line number, key) of each key with no comment line right above it. Not settings: the `defaults` list,
    `_target_`/`_partial_`, and `hydra:` (Hydra's own run-folder keys, documented by Hydra)."""
    lines, out, skip_below = text.split("\n"), [], None
    for i, line in enumerate(lines):
        match = KEY.match(line)
        if not match or line.lstrip().startswith("#"):
            continue
        indent = len(match["indent"])
        if skip_below is not None and indent > skip_below:
            continue
        skip_below = None
        key, value = match["key"], match["value"].split(" #")[0].strip()
        if key in ("defaults", "hydra") and indent == 0:
            skip_below = 0
            continue
        if key.startswith("_") or HANDED_ON.fullmatch(value):
            continue
        above = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        if not above.startswith("#"):
            out.append((i + 1, key))
    return out


def test_the_checker_finds_a_key_without_a_comment():
    text = ("defaults:\n  - default\n_target_: f\n# the rate\nlr: 1\nbeta: ${..beta}\nwd: 0\n"
            "hydra:\n  run:\n    dir: x\n")
    assert uncommented(text) == [(7, "wd")]


def test_every_conf_key_has_a_comment_above_it():
    missing = [f"{path.relative_to(REPO)}:{line} {key}" for path in sorted((REPO / "conf").rglob("*.yaml"))
               for line, key in uncommented(path.read_text())]
    assert not missing, "a key without a comment line above it (its type, default, range, one sentence):\n" + \
        "\n".join(missing)
