"""The Makefile's venv step: a venv from another or too old a Python is made again, a too old PYTHON refused."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import ensure_venv
from tests.support import ROOT

REQUIRES, CLAUSES = ensure_venv.parse_requires_python((ROOT / "pyproject.toml").read_text())


def _decide(
    python: tuple[int, int, int],
    venv_python: tuple[int, int, int] | None,
    *,
    chosen: bool = False,
    exists: bool | None = None,
) -> ensure_venv.Decision:
    return ensure_venv.decide(
        requires=REQUIRES,
        clauses=CLAUSES,
        python=python,
        python_name="python3",
        python_chosen=chosen,
        venv=".venv",
        venv_python=venv_python,
        venv_exists=venv_python is not None if exists is None else exists,
    )


def test_requires_python_is_read_from_pyproject() -> None:
    assert REQUIRES == ">=3.11"
    assert ensure_venv.satisfies((3, 11, 0), CLAUSES) and ensure_venv.satisfies((3, 13, 1), CLAUSES)
    assert not ensure_venv.satisfies((3, 10, 13), CLAUSES)
    _, bounded = ensure_venv.parse_requires_python('requires-python = ">=3.11.4, <3.14"\n')
    assert [ensure_venv.satisfies(v, bounded) for v in ((3, 11, 3), (3, 11, 4), (3, 13, 9), (3, 14, 0))] == [
        False,
        True,
        True,
        False,
    ]
    with pytest.raises(ValueError, match="reads only >=, >, <= and < clauses"):
        ensure_venv.parse_requires_python('requires-python = "~=3.11"\n')


def test_a_venv_is_made_with_a_new_enough_python_and_refused_with_an_old_one() -> None:
    assert _decide((3, 11, 7), None) == ("make", "making .venv with PYTHON=python3 (Python 3.11.7)")
    action, reason = _decide((3, 10, 13), None)
    assert action == "refuse"
    assert reason == (
        "geserve needs Python >=3.11, and PYTHON=python3 (Python 3.10.13) is not: name a Python >=3.11, "
        "e.g. `make run PYTHON=python3.11`"
    )


def test_a_venv_of_another_python_is_made_again_when_python_is_chosen() -> None:
    action, reason = _decide((3, 11, 7), (3, 12, 1), chosen=True)
    assert action == "make"
    assert reason.startswith(".venv was made by Python 3.12.1, and PYTHON=python3 (Python 3.11.7) is another")
    # Another patch release of the same minor version is the same Python to a venv's packages.
    assert _decide((3, 11, 2), (3, 11, 7), chosen=True).action == "keep"


def test_a_good_venv_is_kept_whatever_the_default_python3_is() -> None:
    assert _decide((3, 12, 1), (3, 11, 7)).action == "keep"
    assert _decide((3, 9, 18), (3, 11, 7)).action == "keep"


def test_a_venv_too_old_or_broken_is_made_again_or_the_old_default_refused() -> None:
    action, reason = _decide((3, 11, 7), (3, 10, 13))
    assert action == "make"
    assert reason.startswith(".venv was made by Python 3.10.13, and geserve needs Python >=3.11: making it again")
    action, reason = _decide((3, 10, 13), (3, 10, 13))
    assert action == "refuse"
    assert reason.startswith(".venv was made by Python 3.10.13, and geserve needs Python >=3.11; geserve needs")
    action, reason = _decide((3, 11, 7), None, exists=True)
    assert (action, reason.split(":")[0]) == ("make", ".venv/bin/python does not run (its Python was removed or moved)")
    # A PYTHON chosen too old is refused even beside a good venv: it is not what was asked for.
    assert _decide((3, 10, 13), (3, 11, 7), chosen=True).action == "refuse"


def _fake_venv(root: Path, version: str) -> Path:
    venv = root / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text(f"version = {version}\n")
    python = venv / "bin" / "python"
    python.write_text(f"#!/bin/sh\necho {version}\n")
    python.chmod(0o755)
    return venv


def test_main_remakes_a_venv_of_another_python_and_adopts_a_good_one_without_reinstalling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    made: list[str] = []
    monkeypatch.setattr(ensure_venv, "make_venv", made.append)
    other = f"3.{sys.version_info[1] + 1}.0"
    venv = _fake_venv(tmp_path, other)
    assert ensure_venv.main(["--venv", str(venv), "--python-name", "python3.x", "--python-chosen"]) == 0
    assert made == [str(venv)]
    assert f"{venv} was made by Python {other}, and PYTHON=python3.x" in capsys.readouterr().out

    made.clear()
    same = ".".join(map(str, sys.version_info[:3]))
    venv = _fake_venv(tmp_path / "same", same)
    os.utime(venv / "pyvenv.cfg", (1_000_000_000, 1_000_000_000))
    assert ensure_venv.main(["--venv", str(venv), "--python-chosen"]) == 0
    assert made == []
    # Stamped as old as the venv: the install stamps that depend on it are not redone.
    assert (venv / ensure_venv.STAMP).stat().st_mtime == 1_000_000_000
    assert capsys.readouterr().out == ""


def _older_python() -> str | None:
    """A Python 3.6-3.10 that runs (pyenv's shims exist for versions it will not start)."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates = [shutil.which(f"python3.{minor}") for minor in range(6, 11)]
    candidates += [str(path) for path in sorted(pyenv.glob("3.*/bin/python3"))]
    for candidate in filter(None, candidates):
        probe = subprocess.run(
            [candidate, "-c", "import sys; print(sys.version_info[1])"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        if probe.returncode == 0 and probe.stdout.strip().isdigit() and 6 <= int(probe.stdout) <= 10:
            return candidate
    return None


def test_make_refuses_an_older_python_before_making_anything(tmp_path: Path) -> None:
    python = _older_python()
    if python is None:
        pytest.skip("no Python 3.6-3.10 on this machine")
    venv = tmp_path / "venv"
    result = subprocess.run(
        ["make", "--no-print-directory", f"{venv}/.installed-run", f"VENV={venv}", f"PYTHON={python}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode != 0
    assert f"geserve needs Python >=3.11, and PYTHON={python} (Python 3." in result.stderr
    assert not venv.exists()


def test_make_keeps_a_venv_that_runs_on_a_host_without_python3(tmp_path: Path) -> None:
    """Only python3.11 installed, no `python3`: the venv it made keeps serving; without one, make says what to do."""
    empty_path = tmp_path / "bin"
    empty_path.mkdir()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    make = shutil.which("make")
    assert make is not None
    environment = {**os.environ, "PATH": str(empty_path)}
    environment.pop("PYTHON", None)
    kept = subprocess.run(
        [make, "--no-print-directory", f"{venv}/.made", f"VENV={venv}"],
        cwd=ROOT, env=environment, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert kept.returncode == 0, kept.stderr
    assert (venv / ensure_venv.STAMP).read_text() == "adopted\n"

    missing = tmp_path / "none"
    refused = subprocess.run(
        [make, "--no-print-directory", f"{missing}/.made", f"VENV={missing}"],
        cwd=ROOT, env=environment, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert refused.returncode != 0
    assert f"no 'python3' on PATH and no {missing} that runs: name a Python >=3.11" in refused.stderr
    assert not missing.exists()
