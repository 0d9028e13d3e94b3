"""docs/architecture.md, the map of geserve/, names only files and folders that exist, and names every package."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "geserve"
# Package folders that are not part of the map: generated code and caches.
UNMAPPED_PACKAGES = {"_generated", "__pycache__"}

_FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_LINK_TARGET = re.compile(r"\]\(\s*<?([^\s)>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
# A relative path: names of word characters, dots and hyphens, separated by slashes, perhaps ending in one.
_PATH = re.compile(r"[A-Za-z0-9_][\w.-]*(?:/[\w.-]+)*/?")
# What a path-like word in a diagram must look like to count: a module or a folder.
_DIAGRAM_PATH = re.compile(r"[A-Za-z0-9_][\w.-]*(?:/[\w.-]+)*(?:\.py|/)")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
# A dotted module name: `geserve.core.api`.
_MODULE = re.compile(r"geserve(?:\.[A-Za-z_]\w*)+")


def _is_path(text: str) -> bool:
    """Whether backticked or linked text names a file or folder: a relative path with a slash, or a Python module
    or Markdown page (`cli.py`, `README.md`)."""
    return _PATH.fullmatch(text) is not None and ("/" in text or text.endswith((".py", ".md")))


def named_paths(text: str) -> Iterator[tuple[int, str, str]]:
    """(line number, path, how it is named) for every file or folder the page names: in code spans, as link targets
    (relative to docs/, marked "link"), as modules or folders in diagrams, and as dotted module names."""
    fence = None
    for number, line in enumerate(text.splitlines(), start=1):
        opening = _FENCE.match(line)
        if fence is None and opening:
            fence = opening.group(1)[0] * 3
            continue
        if fence is not None:
            if line.strip().startswith(fence):
                fence = None
                continue
            for word in line.split():
                path = word.strip("(),;:'\"")
                if _DIAGRAM_PATH.fullmatch(path):
                    yield number, path, "diagram"
            continue
        for match in _LINK_TARGET.finditer(line):
            target = match.group(1).partition("#")[0]
            if target and not _SCHEME.match(target) and not target.startswith("/"):
                yield number, target, "link"
        for match in _CODE_SPAN.finditer(line):
            span = match.group(2).strip()
            if _is_path(span):
                yield number, span, "code"
            elif _MODULE.fullmatch(span):
                yield number, span, "module"


def resolve(path: str, how: str, page: Path = PAGE, root: Path = ROOT) -> Path | None:
    """The file or folder a named path is, or None when there is none: a link is relative to the page; any other
    path to the repository's root or to geserve/; a dotted name is a module or package of geserve."""
    if how == "module":
        relative = Path(*path.split("."))
        candidates = [root / relative.with_suffix(".py"), root / relative / "__init__.py"]
        found = next((candidate for candidate in candidates if candidate.is_file()), None)
        return None if found is None else (found.parent if found.name == "__init__.py" else found).resolve()
    bases = [page.parent] if how == "link" else [root, root / "geserve"]
    for base in bases:
        candidate = (base / path).resolve()
        if candidate.is_relative_to(root) and (candidate.is_dir() if path.endswith("/") else candidate.exists()):
            return candidate
    return None


def missing_paths(page: Path = PAGE, root: Path = ROOT) -> list[str]:
    """One line per named file or folder that does not exist."""
    return [
        f"{page.name}:{number}: `{path}` ({how}) names nothing in the repository"
        for number, path, how in named_paths(page.read_text(encoding="utf-8"))
        if resolve(path, how, page, root) is None
    ]


def packages(package: Path = PACKAGE) -> list[Path]:
    """Every package folder of geserve/, nested ones too, but for generated code and caches."""
    return sorted(
        init.parent
        for init in package.rglob("__init__.py")
        if init.parent != package and not UNMAPPED_PACKAGES & set(init.parent.relative_to(package).parts)
    )


def unmapped_packages(page: Path = PAGE, root: Path = ROOT) -> list[str]:
    """The package folders of geserve/ the page does not name."""
    named = {
        resolved
        for _, path, how in named_paths(page.read_text(encoding="utf-8"))
        if (resolved := resolve(path, how, page, root)) is not None
    }
    return [str(folder.relative_to(root)) for folder in packages(root / "geserve") if folder.resolve() not in named]


def test_every_named_file_and_folder_exists() -> None:
    assert len(list(named_paths(PAGE.read_text(encoding="utf-8")))) > 100, "the page names the files it maps"
    assert missing_paths() == []


def test_every_package_is_on_the_map() -> None:
    assert len(packages()) >= 12
    assert unmapped_packages() == [], "packages of geserve/ that docs/architecture.md does not name"


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    for name in ("geserve/core/service.py", "geserve/core/__init__.py", "geserve/cli.py", "README.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    for package in ("geserve/newpackage", "geserve/_generated", "geserve/core/__pycache__"):
        (tmp_path / package).mkdir(parents=True, exist_ok=True)
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "docs").mkdir()
    return tmp_path


def test_a_gone_file_and_an_unnamed_package_are_found(tree: Path) -> None:
    page = tree / "docs" / "architecture.md"
    page.write_text(
        "# Map\n\n`core/service.py`, `geserve/core/`, `cli.py`, `geserve.core.service` and `README.md` exist;\n"
        "`core/gone.py` and `geserve.core.gone` do not. [service](../geserve/core/service.py) "
        "[gone](../geserve/gone.py) [web](https://example.com/x.py) `/dev/shm` `s3://bucket/x` `HTTP :8000`\n"
        "```\nhttp/ grpc/  core/service.py  in/out  HTTP/gRPC  (cli.py)\n```\n"
        "`core/service.py/` names a folder, which it is not.\n"
    )
    assert missing_paths(page, tree) == [
        "architecture.md:4: `../geserve/gone.py` (link) names nothing in the repository",
        "architecture.md:4: `core/gone.py` (code) names nothing in the repository",
        "architecture.md:4: `geserve.core.gone` (module) names nothing in the repository",
        "architecture.md:6: `http/` (diagram) names nothing in the repository",
        "architecture.md:6: `grpc/` (diagram) names nothing in the repository",
        "architecture.md:8: `core/service.py/` (code) names nothing in the repository",
    ]
    assert unmapped_packages(page, tree) == ["geserve/newpackage"]
