"""--log-format=json: every line of every process (supervisor, engine, protocol, workers, uvicorn) is one JSON object."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.support import GeserveProcess, config_text, write_identity_model, write_python_model

# Both layouts are chosen here, whatever the suite's mode.
pytestmark = [pytest.mark.e2e, pytest.mark.one_layout]

LEVELS = {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}
TALKER = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        pb_utils.Logger.log_info("talker initialized")

    def execute(self, requests):
        pb_utils.Logger.log_warn("talker executes")
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())])
            for r in requests
        ]
"""


def _repository(root: Path) -> Path:
    repository = root / "models"
    write_identity_model(repository, "echo")
    tensors: dict[str, Any] = {"inputs": [("INPUT0", "TYPE_FP32", "-1")], "outputs": [("OUTPUT0", "TYPE_FP32", "-1")]}
    write_python_model(repository, "talker", TALKER, config_text("talker", backend="python", **tensors))
    return repository


def _lines(text: str) -> list[dict[str, Any]]:
    """Every line as its JSON object, each checked for the fields every line has."""
    parsed = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise AssertionError(f"not a JSON line: {line!r}\n{text}") from None
        assert isinstance(record, dict), line
        assert {"time", "level", "logger", "message", "pid"} <= record.keys(), line
        assert datetime.fromisoformat(record["time"]).utcoffset() is not None, line
        assert record["level"] in LEVELS, line
        parsed.append(record)
    return parsed


def _bad_requests(server: GeserveProcess) -> None:
    """One inference request with an input the model does not have, over each protocol; one good request to the
    python model, whose worker logs as it executes."""
    data = np.ones((1, 3), dtype=np.float32).reshape(3)
    with httpclient.InferenceServerClient(server.url) as http:
        wrong = httpclient.InferInput("NOPE", [3], "FP32")
        wrong.set_data_from_numpy(data)
        with pytest.raises(InferenceServerException, match="unexpected inference input 'NOPE'"):
            http.infer("echo", [wrong], request_id="bad-http-1")
        good = httpclient.InferInput("INPUT0", [3], "FP32")
        good.set_data_from_numpy(data)
        assert http.infer("talker", [good], request_id="good-1").as_numpy("OUTPUT0").tolist() == [1.0, 1.0, 1.0]
    with grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}") as grpc:
        wrong_grpc = grpcclient.InferInput("NOPE", [3], "FP32")
        wrong_grpc.set_data_from_numpy(data)
        with pytest.raises(InferenceServerException, match="unexpected inference input 'NOPE'"):
            grpc.infer("echo", [wrong_grpc], request_id="bad-grpc-1")


def _set_log_format(server: GeserveProcess, log_format: str) -> dict[str, Any]:
    request = urllib.request.Request(
        f"http://{server.url}/v2/logging", data=json.dumps({"log_format": log_format}).encode(), method="POST"
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        settings: dict[str, Any] = json.loads(response.read())
    return settings


@pytest.mark.parametrize(("frontend_processes", "to_file"), [(1, False), (2, True)], ids=["one-process", "several"])
def test_every_line_is_json(
    launch: Callable[..., GeserveProcess], tmp_path: Path, frontend_processes: int, to_file: bool
) -> None:
    log_file = tmp_path / "json.log"
    flags = [
        f"--model-repository={_repository(tmp_path)}",
        "--log-format=json",
        "--log-verbose=1",  # failed requests and uvicorn's access log are debug lines
        f"--frontend-processes={frontend_processes}",
    ]
    server = launch(*flags, *([f"--log-file={log_file}"] if to_file else [])).wait_live()
    _bad_requests(server)
    assert _set_log_format(server, "json")["log_format"] == "json"  # the logging extension takes it too
    assert server.stop() == 0, server.log()
    console = server.log()
    if to_file:
        assert console == "", "with --log-file, no process writes to the console"
    lines = _lines(log_file.read_text() if to_file else console)

    for request_id, protocol in (("bad-http-1", "HTTP"), ("bad-grpc-1", "gRPC")):
        failed = [line for line in lines if line.get("request_id") == request_id]
        assert failed, f"no line for the {protocol} request"
        assert (failed[0]["model"], failed[0]["version"]) == ("echo", "1"), failed
        assert "unexpected inference input 'NOPE'" in failed[0]["message"], failed
    # The python model's own lines, from its worker process, with the worker's fields.
    worker = [line for line in lines if line["logger"] == "geserve.python_model"]
    assert {line["message"] for line in worker} == {"talker initialized", "talker executes"}, worker
    assert all((line["model"], line["version"], line["instance"]) == ("talker", "1", "talker_0") for line in worker)
    assert any(
        line["logger"] == "uvicorn.access" and '"POST /v2/models/echo/infer' in line["message"] for line in lines
    )
    # Lines with the request's fields are about requests only: a model's ready line names no request.
    ready = [line for line in lines if "' version 1 (" in line["message"]]
    assert ready and not any("request_id" in line for line in ready), ready
    workers = {line["pid"] for line in worker}
    engine = {line["pid"] for line in lines if line["logger"] == "geserve.core.repository"}
    protocol = {line["pid"] for line in lines if line["logger"] == "geserve.frontdoor.service"}
    assert len(workers) == 1 and len(engine) == 1 and not workers & engine, lines
    if frontend_processes == 1:
        assert protocol == engine, "one process serves and runs the models"
    else:
        supervisor = {line["pid"] for line in lines if line["logger"] == "geserve.multiprocess.supervisor"}
        assert len(supervisor) == 1 and protocol and not protocol & (supervisor | engine | workers), lines
        assert not supervisor & (engine | workers), lines
