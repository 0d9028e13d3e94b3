"""A server configured by GESERVE_<FLAG> variables, the command line winning; an unknown variable stops the start."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.support import ROOT, SUITE_SERVERS, free_ports, http_status, write_identity_model

pytestmark = [pytest.mark.e2e, pytest.mark.one_layout]  # the environment chooses the layout here


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def _index(url: str) -> dict[str, str]:
    request = urllib.request.Request(f"{url}/v2/repository/index", data=b"{}", method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        return {entry["name"]: entry.get("state", "") for entry in json.loads(response.read())}


def _environment(**variables: str) -> dict[str, str]:
    """The test process's environment without its GESERVE_ variables (the suite's mode among them), plus these."""
    inherited = {name: value for name, value in os.environ.items() if not name.startswith("GESERVE_")}
    return {**inherited, "PYTHONUNBUFFERED": "1", **variables}


@pytest.mark.parametrize("frontend_processes", ["1", "2"])
def test_a_server_configured_by_its_environment(tmp_path: Path, frontend_processes: str) -> None:
    repository = tmp_path / "models"
    for name in ("first", "second", "third"):
        write_identity_model(repository, name)
    http_port, grpc_port, metrics_port = free_ports(3)
    environment = _environment(
        GESERVE_MODEL_REPOSITORY=str(repository),
        GESERVE_HTTP_ADDRESS="127.0.0.1",
        GESERVE_HTTP_PORT=str(http_port),
        GESERVE_GRPC_PORT=str(grpc_port),
        GESERVE_METRICS_PORT=str(metrics_port),
        GESERVE_MODEL_CONTROL_MODE="explicit",
        GESERVE_LOAD_MODEL='["first", "second"]',
        GESERVE_STRICT_READINESS="false",
        GESERVE_FRONTEND_PROCESSES=frontend_processes,
        GESERVE_ID="from-the-environment",
    )
    log = tmp_path / "geserve.log"
    with log.open("wb") as output:
        # --id on the command line wins over GESERVE_ID.
        command = [sys.executable, "-m", "geserve", "--id=from-the-command-line"]
        server = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, cwd=ROOT, env=environment)
    SUITE_SERVERS.add(server.pid)
    url = f"http://127.0.0.1:{http_port}"
    try:
        deadline = time.monotonic() + 90
        while not (_answers(f"{url}/v2/health/ready") and _answers(f"http://127.0.0.1:{metrics_port}/metrics")):
            assert server.poll() is None, f"geserve exited with {server.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        assert _get(f"{url}/v2")["name"] == "from-the-command-line"
        assert _index(url) == {"first": "READY", "second": "READY", "third": ""}
        # GESERVE_FRONTEND_PROCESSES chose the layout: a supervisor names the protocol processes it starts.
        assert ("started protocol process 1 " in log.read_text()) == (frontend_processes == "2"), log.read_text()
    finally:
        with contextlib.suppress(ProcessLookupError):
            server.send_signal(signal.SIGTERM)
        status = server.wait(60)
    assert status == 0, log.read_text()


def _answers(url: str) -> bool:
    try:
        return http_status(url) == 200
    except OSError:
        return False


def test_an_unknown_variable_stops_the_start(tmp_path: Path) -> None:
    environment = _environment(GESERVE_HTTP_PROT="9000")
    command = [sys.executable, "-m", "geserve", f"--model-repository={tmp_path}"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=environment, timeout=60, check=False)
    assert result.returncode == 2, result.stderr
    assert "GESERVE_HTTP_PROT names no geserve flag; did you mean GESERVE_HTTP_PORT?" in result.stderr
