"""The dependency direction of DESIGN.md, checked by walking every module's imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support import ROOT

PACKAGE = ROOT / "geserve"
FRONT_END_LIBRARIES = ("fastapi", "starlette", "uvicorn", "grpc")
FRONT_ENDS = ("geserve.http", "geserve.grpc", "geserve.metrics", "geserve.server", "geserve.cli", "geserve.__main__")
# Layer -> geserve packages it must not import.
FORBIDDEN = {
    "geserve.core": ("geserve.http", "geserve.grpc", "geserve.server", "geserve.cli"),
    "geserve.batching": ("geserve.core", "geserve.http", "geserve.grpc", "geserve.server"),
    "geserve.workers": ("geserve.core", "geserve.batching", "geserve.http", "geserve.grpc", "geserve.server"),
    "geserve.backends": (
        "geserve.core",
        "geserve.batching",
        "geserve.workers",
        "geserve.http",
        "geserve.grpc",
        "geserve.server",
    ),
    "geserve.repository": ("geserve.core", "geserve.batching", "geserve.workers", "geserve.backends", "geserve.http"),
    "geserve.codecs": ("geserve.core", "geserve.batching", "geserve.workers", "geserve.backends", "geserve.http"),
    "geserve.errors": ("geserve.",),
    "geserve.types": ("geserve.core", "geserve.batching", "geserve.workers", "geserve.backends", "geserve.http"),
}


def _modules() -> list[tuple[str, Path]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(ROOT).with_suffix("")
        name = ".".join(relative.parts).removesuffix(".__init__")
        if not name.startswith("geserve._generated"):
            found.append((name, path))
    return found


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize(("module", "path"), _modules(), ids=[m for m, _ in _modules()])
def test_dependency_direction(module: str, path: Path) -> None:
    imported = _imports(path)
    if not module.startswith(FRONT_ENDS):
        bad = sorted(n for n in imported if n.split(".")[0] in FRONT_END_LIBRARIES)
        assert not bad, f"{module} sits below the front-ends but imports {bad}"
    for layer, forbidden in FORBIDDEN.items():
        if module == layer or module.startswith(layer + "."):
            bad = sorted(
                n for n in imported if any(n == f or n.startswith(f if f.endswith(".") else f + ".") for f in forbidden)
            )
            assert not bad, f"{module} must not import {bad}"


@pytest.mark.parametrize(("module", "path"), _modules(), ids=[m for m, _ in _modules()])
def test_every_module_has_a_one_line_docstring(module: str, path: Path) -> None:
    docstring = ast.get_docstring(ast.parse(path.read_text()))
    assert docstring, f"{module} has no module docstring"
    assert "\n" not in docstring.strip(), f"{module}'s docstring should be one line"
