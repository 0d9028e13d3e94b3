"""Traces in process: the core's moments come with the response, the front-end's are added, the file gets both."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from geserve.errors import GeserveError
from geserve.settings import ServerSettings
from geserve.types import InferInput, InferRequest
from tests.component.conftest import in_process_server
from tests.support import write_identity_model

PYTHON_MODELS = Path(__file__).resolve().parents[1] / "python_models"
CORE = ["REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END"]


async def test_a_response_carries_its_trace_and_a_failed_request_is_traced_too(tmp_path: Path) -> None:
    repository = tmp_path / "models"
    write_identity_model(repository, "echo")
    shutil.copytree(PYTHON_MODELS / "raises", repository / "raises")
    path = tmp_path / "trace.json"
    trace = {"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_file": str(path)}
    served = await in_process_server(repository, ServerSettings(trace=trace))
    service = served.door
    try:
        echo = InferRequest("echo", "", (InferInput("INPUT0", "FP32", (1, 4), np.ones((1, 4), np.float32)),))
        response = await service.infer(echo)
        assert response.trace is not None
        assert [name for name, _ in response.trace.timestamps] == [*CORE, "REQUEST_END"]
        await service.record_trace(response.trace.around((("HTTP_RECV_START", 1),), (("HTTP_SEND_END", 2),)))
        failing = InferRequest("raises", "", (InferInput("IN", "INT32", (1,), np.full(1, 13, np.int32)),), id="bad")
        with pytest.raises(GeserveError):
            await service.infer(failing)
        untraced = await service.update_trace_settings(None, {"trace_level": ["OFF"]})
        assert untraced["trace_level"] == ["OFF"]
        assert (await service.infer(echo)).trace is None
    finally:
        await served.shutdown()
    written = json.loads(path.read_text())
    heads = [item for item in written if "model_name" in item]
    assert [(head["model_name"], head.get("request_id")) for head in heads] == [("echo", None), ("raises", "bad")]
    names = {head["id"]: [] for head in heads}
    for item in written:
        if "timestamps" in item:
            names[item["id"]].append(item["timestamps"][0]["name"])
    assert list(names.values()) == [
        ["HTTP_RECV_START", *CORE, "REQUEST_END", "HTTP_SEND_END"],
        ["REQUEST_START", "REQUEST_END"],
    ]
