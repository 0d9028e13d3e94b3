"""deploy/docker/ascend-entrypoint.sh run with its Ascend root moved into a temporary folder: which set_env.sh it
sources, and what it says when there is none."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.support import ROOT

ENTRYPOINT = ROOT / "deploy" / "docker" / "ascend-entrypoint.sh"
ROOT_LINE = "ascend_root=/usr/local/Ascend\n"
GESERVE_LINE = "geserve=/opt/geserve/venv/bin/geserve\n"


def _run(tmp_path: Path, *set_envs: str) -> subprocess.CompletedProcess[str]:
    """The entrypoint with `tmp_path/Ascend` as its root, a set_env.sh at each of `set_envs` (relative to it) that
    says which it is, and a `geserve` on PATH that prints what the sourced script set."""
    root = tmp_path / "Ascend"
    for relative in set_envs:
        script = root / relative
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text(f"export SOURCED_SET_ENV={relative}\n")
    (root / "driver" / "lib64").mkdir(parents=True)
    text = ENTRYPOINT.read_text()
    assert text.count(ROOT_LINE) == 1 and text.count(GESERVE_LINE) == 1
    bin_dir = tmp_path / "venv" / "bin"  # the image's venv, which is not on PATH
    bin_dir.mkdir(parents=True)
    geserve = bin_dir / "geserve"
    entrypoint = tmp_path / "entrypoint.sh"
    entrypoint.write_text(
        text.replace(ROOT_LINE, f"ascend_root={root}\n").replace(GESERVE_LINE, f"geserve={geserve}\n")
    )
    geserve.write_text('#!/bin/sh\necho "sourced=${SOURCED_SET_ENV:-none} args=$*"\n')
    geserve.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "ASCEND_PROCESS_LOG_PATH": str(tmp_path / "log")}
    return subprocess.run(
        ["sh", str(entrypoint), "--model-repository=/models"],
        env=env, capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("installed", "sourced"),
    [
        (("cann/set_env.sh", "ascend-toolkit/set_env.sh", "nnrt/set_env.sh"), "cann/set_env.sh"),
        (("ascend-toolkit/set_env.sh", "nnrt/set_env.sh"), "ascend-toolkit/set_env.sh"),
        (("nnrt/set_env.sh",), "nnrt/set_env.sh"),
    ],
)
def test_the_newest_cann_layouts_set_env_is_sourced_before_geserve_starts(
    tmp_path: Path, installed: tuple[str, ...], sourced: str
) -> None:
    """CANN 8.5 and newer install /usr/local/Ascend/cann/set_env.sh, older CANN ascend-toolkit/set_env.sh."""
    result = _run(tmp_path, *installed)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"sourced={sourced} args=--model-repository=/models\n"
    assert result.stderr == ""


def test_without_any_set_env_it_says_where_it_looked_and_still_starts(tmp_path: Path) -> None:
    result = _run(tmp_path)
    assert result.returncode == 0
    assert result.stdout == "sourced=none args=--model-repository=/models\n"
    root = tmp_path / "Ascend"
    assert result.stderr == (
        f"geserve: no CANN set_env.sh at {root}/cann/set_env.sh (CANN 8.5 and newer), "
        f"{root}/ascend-toolkit/set_env.sh (older CANN) or {root}/nnrt/set_env.sh; pyACL will not import and .om "
        "models will not load\n"
    )


def test_the_image_keeps_its_venv_off_path_so_atc_finds_the_cann_python() -> None:
    """ATC's operator compiler runs in the `python3` on PATH: the CANN base image's, which has what CANN needs, not
    geserve's venv (numpy 2, protobuf 6); the entrypoint starts geserve by its path instead."""
    dockerfile = (ROOT / "deploy" / "docker" / "Dockerfile.ascend").read_text()
    assert "VIRTUAL_ENV=" not in dockerfile and "PATH=/opt/geserve/venv/bin" not in dockerfile
    assert 'exec "$geserve"' in ENTRYPOINT.read_text() and GESERVE_LINE in ENTRYPOINT.read_text()
