"""Triton's own load generator against geserve: it must run and read server-side statistics."""

from __future__ import annotations

import subprocess

import pytest

from tests.support import ROOT, GeserveProcess

pytestmark = pytest.mark.e2e

PERF_ANALYZER = ROOT.parent / "shared" / "tools" / "perf_analyzer"


@pytest.fixture(scope="module")
def perf_analyzer() -> str:
    """The tool, fetched on first use; a machine that cannot fetch it skips (the tool is not ours)."""
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


def run_briefly(perf_analyzer: str, protocol: str, url: str, *extra: str) -> str:
    """perf_analyzer against `simple` for a few half-second windows; returns its output after
    checking it succeeded."""
    command = [
        perf_analyzer, "-m", "simple", "-i", protocol, "-u", url, *extra,
        "--concurrency-range", "2", "--measurement-interval", "500", "--max-trials", "6",
        "--stability-percentage", "100",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=540, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return output


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.timeout(600)
def test_perf_analyzer_reports_server_side_times(server: GeserveProcess, perf_analyzer: str, protocol: str) -> None:
    port = server.http_port if protocol == "http" else server.grpc_port
    output = run_briefly(perf_analyzer, protocol, f"127.0.0.1:{port}")
    assert "missing statistics" not in output
    assert "Server:" in output
    assert "queue" in output and "compute infer" in output
