"""scripts/write_constraints.py refuses to write pins from an interpreter that lacks geserve or its dependencies."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest

from scripts import write_constraints


def _without(monkeypatch: pytest.MonkeyPatch, *absent: str) -> None:
    """metadata.distribution as an interpreter without these distributions answers it."""
    real = metadata.distribution

    def distribution(name: str) -> metadata.Distribution:
        if name in absent:
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(write_constraints.metadata, "distribution", distribution)


def test_without_geserve_nothing_is_written_and_the_exit_says_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "constraints.txt"
    monkeypatch.setattr(write_constraints, "TARGET", target)
    _without(monkeypatch, "geserve")
    assert write_constraints.main() == 1
    assert not target.exists()
    error = capsys.readouterr().err
    assert "not installed in" in error and "geserve" in error and "pip install -e '.[onnx]'" in error


def test_a_missing_runtime_dependency_is_named_with_what_needs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    _without(monkeypatch, "orjson", "onnxruntime")
    with pytest.raises(LookupError, match=r"onnxruntime \(needed by geserve\), orjson \(needed by geserve\)"):
        write_constraints.runtime_closure()


def test_with_everything_installed_every_runtime_dependency_is_pinned(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    target = tmp_path / "constraints.txt"
    monkeypatch.setattr(write_constraints, "TARGET", target)
    monkeypatch.setattr(write_constraints, "ROOT", tmp_path)
    assert write_constraints.main() == 0
    pins = [line for line in target.read_text().splitlines() if line and not line.startswith("#")]
    assert {line.partition("==")[0] for line in pins} >= {"numpy", "onnxruntime", "orjson", "uvicorn"}
