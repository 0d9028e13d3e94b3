"""The docs hold together: every relative link in the repository's Markdown reaches a file (and, for a `#fragment`
into a Markdown page, one of its headings, by GitHub's anchor rules), and every page of docs/ is linked from another
page and reachable from the README."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Folders that are not the repository's own pages: virtual environments, build output, caches, git's own.
_SKIPPED_FOLDERS = {"build", "node_modules", "__pycache__", "bench-results"}

_FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
# [text](target "title") and ![alt](target); the text may hold one level of brackets.
_INLINE_LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^\s)]+)(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)"
)
# [label]: target
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
_HTML_ANCHOR = re.compile(r"<a\s[^>]*(?:name|id)=\"([^\"]+)\"")
_SCHEME = re.compile(r"^(?:[a-zA-Z][a-zA-Z0-9+.-]*:|//)")


def markdown_files(root: Path) -> list[Path]:
    """Every .md file of the tree, outside hidden folders (.git, .venv, ...), build output and caches."""
    found: list[Path] = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(
            name
            for name in subfolders
            if not name.startswith(".") and name not in _SKIPPED_FOLDERS and not name.endswith(".egg-info")
        )
        found.extend(Path(folder) / name for name in sorted(files) if name.endswith(".md"))
    return found


def _prose(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) for each line outside fenced code blocks."""
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        opening = _FENCE.match(line)
        if fence is None and opening:
            fence = opening.group(1)[0] * 3
        elif fence is not None and line.strip().startswith(fence):
            fence = None
        elif fence is None:
            yield number, line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text (link targets and code backticks dropped), lowercase, punctuation
    other than hyphens and underscores removed, each space a hyphen."""
    text = re.sub(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\([^)]*\)", r"\1", heading)
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The fragments a link into the page may name: one per heading (repeats get -1, -2, ...), and HTML anchors."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in _prose(page.read_text(encoding="utf-8")):
        heading = _HEADING.match(line)
        if heading:
            base = slug(heading.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
        found.update(_HTML_ANCHOR.findall(line))
    return found


def links(page: Path) -> Iterator[tuple[int, str]]:
    """(line number, target) of every link on the page outside code: inline links, images and reference
    definitions."""
    for number, raw in _prose(page.read_text(encoding="utf-8")):
        line = _CODE_SPAN.sub("code", raw)
        targets = [match.group(1) for match in _INLINE_LINK.finditer(line)]
        reference = _REFERENCE.match(line)
        if reference:
            targets.append(reference.group(1))
        for target in targets:
            yield number, target.removeprefix("<").removesuffix(">")


def resolve(page: Path, target: str, root: Path) -> tuple[Path, str] | None:
    """The file a relative link names and its fragment; None for a link with a scheme (https:, mailto:, ...)."""
    if _SCHEME.match(target):
        return None
    path, _, fragment = target.partition("#")
    path = unquote(path)
    if not path:
        return page, fragment
    base = root if path.startswith("/") else page.parent
    return Path(os.path.normpath(base / path.lstrip("/"))), fragment


def broken_links(root: Path) -> list[str]:
    """One line per relative link that names no file of the tree, or a heading its Markdown page lacks."""
    problems: list[str] = []
    for page in markdown_files(root):
        for number, target in links(page):
            resolved = resolve(page, target, root)
            if resolved is None:
                continue
            path, fragment = resolved
            where = f"{page.relative_to(root)}:{number}: ({target})"
            if not path.is_relative_to(root):
                problems.append(f"{where} leaves the repository")
            elif not path.exists():
                problems.append(f"{where} names no file")
            elif fragment and path.suffix == ".md" and fragment not in anchors(path):
                problems.append(f"{where} names no heading of {path.relative_to(root)}")
    return problems


def _link_graph(root: Path) -> dict[Path, set[Path]]:
    """Each Markdown page -> the other Markdown pages it links to."""
    graph: dict[Path, set[Path]] = {}
    for page in markdown_files(root):
        targets = graph.setdefault(page, set())
        for _, target in links(page):
            resolved = resolve(page, target, root)
            if resolved is not None and resolved[0].suffix == ".md" and resolved[0] != page:
                targets.add(resolved[0])
    return graph


def docs_pages(root: Path) -> list[Path]:
    return sorted((root / "docs").rglob("*.md"))


def orphan_pages(root: Path) -> list[str]:
    """The docs pages no other page of the README or docs/ links to."""
    graph = _link_graph(root)
    sources = [root / "README.md", *docs_pages(root)]
    return [
        str(page.relative_to(root))
        for page in docs_pages(root)
        if not any(page in graph.get(source, set()) for source in sources if source != page)
    ]


def unreachable_pages(root: Path) -> list[str]:
    """The docs pages a reader cannot reach from the README by following links."""
    graph = _link_graph(root)
    reached = {root / "README.md"}
    frontier = [root / "README.md"]
    while frontier:
        for target in graph.get(frontier.pop(), set()):
            if target not in reached:
                reached.add(target)
                frontier.append(target)
    return [str(page.relative_to(root)) for page in docs_pages(root) if page not in reached]


def test_every_relative_link_reaches_a_file_and_heading() -> None:
    assert len(markdown_files(ROOT)) >= 3, "README.md, docs/ and deploy/README.md are found"
    assert broken_links(ROOT) == []


def test_every_docs_page_is_linked_from_another_page() -> None:
    assert docs_pages(ROOT), "docs/ has pages"
    assert orphan_pages(ROOT) == []


def test_every_docs_page_is_reachable_from_the_readme() -> None:
    assert unreachable_pages(ROOT) == []


def test_the_readme_links_every_docs_page_and_the_deployment_guide() -> None:
    linked = _link_graph(ROOT)[ROOT / "README.md"]
    missing = [page for page in [*docs_pages(ROOT), ROOT / "deploy" / "README.md"] if page not in linked]
    assert [str(page.relative_to(ROOT)) for page in missing] == []


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        (
            "One engine, N protocol processes (`--frontend-processes`)",
            "one-engine-n-protocol-processes---frontend-processes",
        ),
        ("Installing perf_analyzer", "installing-perf_analyzer"),
        ("Model configuration (`config.pbtxt`)", "model-configuration-configpbtxt"),
        (
            "NPU-bound: ResNet-50 on simulated NPUs, against Triton and MLServer",
            "npu-bound-resnet-50-on-simulated-npus-against-triton-and-mlserver",
        ),
        ("See [the guide](guide.md) **now**", "see-the-guide-now"),
    ],
)
def test_slugs_follow_github(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor


def test_a_broken_link_and_an_orphan_page_are_found(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "# Project\n\n[a](docs/a.md) [gone](docs/gone.md) [b's part](docs/a.md#no-such-part)\n"
        "```\n[in code](nowhere.md)\n```\n`[in a span](nowhere.md)` [web](https://example.com/x.md)\n"
    )
    (tmp_path / "docs" / "a.md").write_text("# A\n\n## Some part\n\n[up](../README.md) [part](#some-part)\n")
    (tmp_path / "docs" / "orphan.md").write_text("# Orphan\n\n[a](a.md)\n")
    (tmp_path / "docs" / "island.md").write_text("# Island\n\n[b](island2.md)\n")
    (tmp_path / "docs" / "island2.md").write_text("# Island 2\n\n[a](island.md) [out](../../outside.md)\n")
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "skipped.md").write_text("[broken](nowhere.md)\n")
    assert broken_links(tmp_path) == [
        "README.md:3: (docs/gone.md) names no file",
        "README.md:3: (docs/a.md#no-such-part) names no heading of docs/a.md",
        "docs/island2.md:3: (../../outside.md) leaves the repository",
    ]
    assert orphan_pages(tmp_path) == ["docs/orphan.md"]
    assert unreachable_pages(tmp_path) == ["docs/island.md", "docs/island2.md", "docs/orphan.md"]
