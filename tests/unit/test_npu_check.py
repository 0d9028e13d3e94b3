"""`make npu-check` fails, saying why, where it cannot run on real hardware, instead of passing by skipping."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.fakes.om_models import write_affine_om
from tests.support import ROOT

FAKES = ROOT / "tests" / "fakes"


def _run_npu_tests(tmp_path: Path, **environment: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **environment, "PYTHONPATH": str(FAKES)}
    command = [sys.executable, "-m", "pytest", "-m", "npu", "-p", "no:cacheprovider", "-q", "tests/e2e/test_npu.py"]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)


def test_required_npu_tests_fail_on_the_simulator_and_skip_otherwise(tmp_path: Path) -> None:
    om = write_affine_om(tmp_path / "model.om", gears=[1, 2])
    required = _run_npu_tests(tmp_path, GESERVE_NPU_OM=str(om), GESERVE_NPU_REQUIRED="1")
    assert required.returncode != 0
    assert "make npu-check cannot run: only the pyACL simulator is importable" in required.stdout + required.stderr
    optional = _run_npu_tests(tmp_path, GESERVE_NPU_OM=str(om), GESERVE_NPU_REQUIRED="0")
    assert optional.returncode == 0, optional.stdout + optional.stderr
    assert "skipped" in optional.stdout


def test_make_npu_check_lists_every_problem_before_installing_anything(tmp_path: Path) -> None:
    """Without CANN, devices or GESERVE_NPU_OM, the preflight fails the target at once: the venv it would
    install into is never made (so the target does not depend on the test extra's install either)."""
    kept = ("ASCEND", "GESERVE_NPU", "LD_LIBRARY_PATH", "PYTHONPATH", "MAKEFLAGS", "MFLAGS")
    env = {key: value for key, value in os.environ.items() if not key.startswith(kept)}
    venv = tmp_path / "venv"
    result = subprocess.run(
        ["make", "--no-print-directory", f"VENV={venv}", f"PYTHON={sys.executable}", "npu-check"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode != 0
    assert "PROBLEM  GESERVE_NPU_OM: GESERVE_NPU_OM is unset -- fix: make npu-check GESERVE_NPU_OM=" in result.stdout
    assert "PROBLEM  set_env.sh: " in result.stdout
    assert "PROBLEM  pyACL: " in result.stdout
    assert "problem(s), nothing was installed" in result.stdout
    assert not venv.exists()
    assert "pip install" not in result.stdout + result.stderr


def test_make_npu_check_installs_the_npu_check_extra_only_after_the_preflight(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    result = subprocess.run(
        ["make", "--no-print-directory", "-n", f"VENV={venv}", "GESERVE_NPU_OM=/models/m.om", "npu-check"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    commands = result.stdout.splitlines()
    preflight = next(i for i, line in enumerate(commands) if "scripts/npu_preflight.py" in line)
    install = next(i for i, line in enumerate(commands) if "pip install" in line and "-e" in line)
    assert preflight < install
    assert commands[install].endswith("-e '.[npu-check]'")
    assert not any("'.[test]'" in line for line in commands)
