"""Triton's own load generator against geserve: it must run and read server-side statistics."""

from __future__ import annotations

import pytest

from tests.support import GeserveProcess, run_perf_analyzer

pytestmark = pytest.mark.e2e


def run_briefly(perf_analyzer: str, protocol: str, url: str, *extra: str) -> str:
    """perf_analyzer against `simple` at concurrency 2; returns its output after checking it succeeded."""
    return run_perf_analyzer(
        perf_analyzer, "-m", "simple", "-i", protocol, "-u", url, "--concurrency-range", "2", *extra
    )


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.timeout(600)
def test_perf_analyzer_reports_server_side_times(server: GeserveProcess, perf_analyzer: str, protocol: str) -> None:
    port = server.http_port if protocol == "http" else server.grpc_port
    output = run_briefly(perf_analyzer, protocol, f"127.0.0.1:{port}")
    assert "missing statistics" not in output
    assert "Server:" in output
    assert "queue" in output and "compute infer" in output
