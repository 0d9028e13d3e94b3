"""What a user reads at the default verbosity from start to stop: one line per model as it becomes ready, one line
per listener, and none of uvicorn's own lifecycle lines."""

from __future__ import annotations

import re
import time
from collections.abc import Callable

from tests.support import MODEL_REPOSITORY, GeserveProcess

SERVICES = ("HTTPService", "GRPCInferenceService", "Metrics Service")
UVICORN_LIFECYCLE = ("Started server process", "Finished server process", "uvicorn.error: Shutting down")


def _started_lines(log: str, service: str) -> list[str]:
    return [line for line in log.splitlines() if f" Started {service} at " in line]


def test_one_line_per_model_and_per_listener(launch: Callable[..., GeserveProcess]) -> None:
    server = launch(f"--model-repository={MODEL_REPOSITORY}").wait_live()
    # With protocol processes, the supervisor says the HTTP and gRPC services started once every one listens.
    deadline = time.monotonic() + 30
    while not all(_started_lines(server.log(), service) for service in SERVICES):
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.1)
    assert server.stop() == 0
    log = server.log()
    models = sorted(folder.name for folder in MODEL_REPOSITORY.iterdir() if (folder / "config.pbtxt").is_file())
    loading = [line for line in log.splitlines() if " loading " in line]
    assert len(loading) == 1 and f"loading {len(models)} model(s) from {MODEL_REPOSITORY}" in loading[0], log
    for name in models:
        ready = [line for line in log.splitlines() if f"successfully loaded '{name}' version 1 (" in line]
        assert len(ready) == 1, (name, log)
        assert re.match(r"I\d{4} \d\d:\d\d:\d\d\.\d{6} \d+ [\w.]+:\d+\] ", ready[0]), ready  # Triton's layout
    assert re.search(r"successfully loaded 'simple' version 1 \(onnxruntime, 1 instance\)$", log, re.MULTILINE), log
    assert re.search(r"successfully loaded 'digits_ensemble' version 1 \(ensemble\)$", log, re.MULTILINE), log
    # Ready before any listener starts: the first request finds every model.
    assert log.index("successfully loaded 'digits_ensemble'") < log.index(" Started HTTPService at ")
    for service in SERVICES:
        lines = _started_lines(log, service)
        assert len(lines) == 1, (service, log)
        if server.multiprocess and service != "Metrics Service":
            assert lines[0].endswith(f"({server.frontend_processes} protocol processes)"), lines
    assert f"Started HTTPService at 127.0.0.1:{server.http_port}" in log, log
    for words in UVICORN_LIFECYCLE:
        assert words not in log, log
    # Each instance says its pid as it comes up (as Triton logs each instance's initialization); the pool's own
    # line would repeat the ready line, so it is there at verbose level 1 only.
    instances = sum(int(count) for count in re.findall(r" version \d+ \(\S+, (\d+) instances?\)$", log, re.M))
    assert instances >= len(models) - 1, log  # all but the ensemble have at least one
    assert len(re.findall(r"instance \S+ of model '\S+' is up \(pid \d+\)", log)) == instances, log
    assert "loaded model '" not in log, log
