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


def test_make_npu_check_needs_the_om_file() -> None:
    env = {k: v for k, v in os.environ.items() if k != "GESERVE_NPU_OM"}
    result = subprocess.run(
        ["make", "--no-print-directory", "-o", ".venv/.installed-test", "npu-check"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert "make npu-check: set GESERVE_NPU_OM=/path/to/model.om" in result.stderr
