"""The README stays a front page and the documentation's links hold.

- README.md has at most 300 lines; the manual lives in docs/*.md.
- Every relative link and image in README.md and docs/*.md points to a file that exists, and a
  `#anchor` into a Markdown file names a heading it has (GitHub's slugs).
- Every docs/*.md page is linked from README.md.

Pure Python (pathlib + re): no network, no model, no third-party Markdown parser.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import REPO

ROOT = REPO
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 300

# [text](target) and ![alt](target); the target ends at whitespace (an optional "title" follows) or ")"
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def _pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with inline code spans blanked out."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, _INLINE_CODE.sub("", line)))
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every Markdown link and image in a file, code excluded."""
    return [(n, m.group(1)) for n, line in _prose_lines(path.read_text(encoding="utf-8"))
            for m in _LINK.finditer(line)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped except - and _, spaces to -."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a Markdown file's headings make; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    text = path.read_text(encoding="utf-8")
    fenced = False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        match = None if fenced else _HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    return out


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """One line per relative link or image of `path` that does not resolve (paths shown from `root`)."""
    problems = []
    for number, target in links(path):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("//"):
            continue  # https:, mailto:, ...: not checked (no network)
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root)}:{number}: {target}"
        if not dest.exists():
            problems.append(f"{where}: {file_part} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where}: no heading #{anchor} in {dest.relative_to(root)} "
                            f"(has: {', '.join(sorted(anchors(dest)))})")
    return problems


def test_readme_is_a_front_page():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines (at most {MAX_README_LINES}): move the detail to a page under docs/")


@pytest.mark.parametrize("path", [README, *_pages()], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    problems = broken_links(path)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_every_page_is_linked_from_the_readme():
    assert _pages(), "docs/ has no .md pages"
    linked = {(README.parent / target.partition("#")[0]).resolve() for _, target in links(README)}
    missing = [str(p.relative_to(ROOT)) for p in _pages() if p.resolve() not in linked]
    assert missing == [], f"not linked from README.md: {', '.join(missing)}"


def test_the_checks_can_fail(tmp_path):
    """The helpers find what they exist to find (guards against a regex that matches nothing)."""
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# Sampling with vLLM (`sampler=vllm`)\n## Speed\n## Speed\n")
    page.write_text(
        "# Page\n[ok](there.md#sampling-with-vllm-samplervllm) [ok](there.md#speed-1) ![img](there.md)\n"
        "[gone](missing.md) [bad anchor](there.md#nope) [web](https://example.com/x.md)\n"
        "`[in code](missing-too.md)`\n```\n[fenced](missing-three.md)\n```\n")
    problems = broken_links(page, root=tmp_path)
    assert len(problems) == 2, problems
    assert "missing.md does not exist" in problems[0]
    assert "no heading #nope" in problems[1]


# the words of our tracker and of a page still being written: a user reads about what the tool does today. An
# issue's number is "#" and digits after a space or a bracket (not a link's #anchor, an HTML entity or a colour)
_TRACKER = re.compile(r"\bissues? #\d+|(?<![\w/&#])#\d+\b|\(draft\b|not wired yet", re.IGNORECASE)


def tracker_words(text: str) -> list[str]:
    return [m.group(0) for m in _TRACKER.finditer(text)]


@pytest.mark.parametrize("path", [README, *_pages()], ids=lambda p: str(p.relative_to(ROOT)))
def test_the_docs_speak_of_the_product_not_the_tracker(path):
    assert tracker_words(path.read_text(encoding="utf-8")) == []


def test_the_tracker_check_can_fail():
    # four hits: a heading's "(issue #44)", a bare "#43's", a draft title, a section still to come; not a link's
    # anchor, an entity or a colour
    text = ("## Speed (issue #44)\nSo #43's target\n# Tools (draft: x)\n## What is not wired yet\nissue-free "
            "[a](page.md#12-steps) &#8212; #1e90ff")
    assert tracker_words(text) == ["issue #44", "#43", "(draft", "not wired yet"]
