"""The documentation's relative links lead somewhere.

Every relative link (`[text](path)`, `[text](path#anchor)`, `[text](#anchor)`)
in the checked files must name a file or directory of the repository, and an
anchor in a Markdown file must be one of its headings as GitHub spells them.
Links inside code (fenced blocks, inline spans) are not links and are skipped;
absolute URLs are not fetched. docs/README.md is the table of contents: every
page under docs/ is listed there.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
CHECKED = sorted(
    [
        REPO / "README.md",
        REPO / "CHANGELOG.md",
        REPO / "sandbox-sdk/README.md",
        REPO / "sandbox-agent/README.md",
        REPO / "devcluster/README.md",
        *DOCS.glob("*.md"),
    ]
)

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
# [text](target) and ![alt](target), with an optional "title".
INLINE_LINK = re.compile(
    r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)"
)
# [label]: target
DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s+<?(\S+?)>?(?:\s+.*)?$")
EXPLICIT_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of everything outside fenced code blocks."""
    lines: list[tuple[int, str]] = []
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), 1):
        opened = FENCE.match(line)
        if fence is None and opened:
            fence = opened.group(1)
        elif fence is not None and line.strip().startswith(fence):
            fence = None
        elif fence is None:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: the rendered text lowercased,
    punctuation dropped (letters, digits, `_`, `-` and spaces stay), each
    space a hyphen."""
    text = INLINE_LINK.sub(lambda m: m.group(1), heading)
    text = CODE_SPAN.sub(lambda m: m.group(2), text)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor of a Markdown file: its headings (a repeated one gets -1,
    -2, ... as GitHub numbers them) and explicit `<a id=...>` anchors."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        found.update(EXPLICIT_ANCHOR.findall(line))
        heading = HEADING.match(line)
        if not heading:
            continue
        base = slug(heading.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link outside code."""
    found: list[tuple[int, str]] = []
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        prose = CODE_SPAN.sub("", line)
        found.extend((number, m.group(2)) for m in INLINE_LINK.finditer(prose))
        definition = DEFINITION.match(prose)
        if definition:
            found.append((number, definition.group(1)))
    return found


def broken(path: Path, root: Path = REPO) -> list[str]:
    """What is wrong with each relative link of `path` (a file under `root`), as
    `file:line: link: why`."""
    problems: list[str] = []
    cache: dict[Path, set[str]] = {}
    for number, target in links(path):
        if SCHEME.match(target) or target.startswith("//"):
            continue
        where = f"{path.relative_to(root)}:{number}: {target}"
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            problems.append(f"{where}: no such file or directory")
            continue
        if root not in resolved.parents and resolved != root:
            problems.append(f"{where}: outside the repository")
            continue
        if not anchor:
            continue
        if resolved.is_dir() or resolved.suffix != ".md":
            problems.append(f"{where}: an anchor into something that is not a Markdown file")
            continue
        if resolved not in cache:
            cache[resolved] = anchors(resolved)
        if anchor not in cache[resolved]:
            problems.append(f"{where}: no heading with anchor #{anchor}")
    return problems


@pytest.mark.parametrize("path", CHECKED, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_and_anchors_resolve(path: Path) -> None:
    assert path.exists()
    problems = broken(path)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_every_page_under_docs_is_in_the_table_of_contents() -> None:
    listed = {
        (DOCS / target.partition("#")[0]).resolve()
        for _, target in links(DOCS / "README.md")
        if not SCHEME.match(target)
    }
    pages = {page.resolve() for page in DOCS.glob("*.md") if page.name != "README.md"}
    missing = sorted(str(page.relative_to(REPO)) for page in pages - listed)
    assert not missing, f"not linked from docs/README.md: {missing}"


def test_the_check_finds_what_is_broken(tmp_path: Path) -> None:
    """The check itself: GitHub's anchors, code skipped, every kind of break seen."""
    assert slug("Python SDK and `kubectl sandbox`") == "python-sdk-and-kubectl-sandbox"
    assert slug("What one sandbox's code can do to the rest") == (
        "what-one-sandboxs-code-can-do-to-the-rest"
    )
    assert slug("Warm pools: a ready sandbox in milliseconds") == (
        "warm-pools-a-ready-sandbox-in-milliseconds"
    )
    assert slug("[Unreleased]") == "unreleased"
    assert slug("Services, DNS and NetworkPolicy on the node (`devcluster/netstack.py`)") == (
        "services-dns-and-networkpolicy-on-the-node-devclusternetstackpy"
    )
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n## Usage\n\n## Usage\n\n```console\n[not](a-link.md)\n# not a heading\n```\n"
    )
    assert anchors(page) == {"title", "usage", "usage-1"}
    assert links(page) == []
    page.write_text("see `[code](nowhere.md)` and [ok](#usage)\n\n## Usage\n")
    assert links(page) == [(1, "#usage")]
    assert broken(page, tmp_path) == []
    (tmp_path / "other.md").write_text("# Other\n")
    page.write_text(
        "[a](other.md#other) [b](other.md#gone) [c](missing.md) [d](#gone)\n"
        "[e](https://example.com/x.md#y) [f](../outside.md)\n"
    )
    (tmp_path.parent / "outside.md").touch()
    assert broken(page, tmp_path) == [
        "page.md:1: other.md#gone: no heading with anchor #gone",
        "page.md:1: missing.md: no such file or directory",
        "page.md:1: #gone: no heading with anchor #gone",
        "page.md:2: ../outside.md: outside the repository",
    ]
