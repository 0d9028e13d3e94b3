"""Fixtures the end-to-end files share: Triton's perf_analyzer, where it runs."""

from __future__ import annotations

import subprocess

import pytest

from tests.support import PERF_ANALYZER


@pytest.fixture(scope="session")
def perf_analyzer() -> str:
    """The tool's path; a machine where it does not run skips (the tool is not ours)."""
    if not PERF_ANALYZER.exists():
        pytest.skip(f"{PERF_ANALYZER} is not here")
    try:
        setup = subprocess.run(
            [str(PERF_ANALYZER), "--version"], capture_output=True, text=True, timeout=500, check=False
        )
    except subprocess.TimeoutExpired:
        pytest.skip("perf_analyzer could not be fetched in time")
    if setup.returncode != 0:
        pytest.skip(f"perf_analyzer is not runnable here: {setup.stderr[-500:]}")
    return str(PERF_ANALYZER)
