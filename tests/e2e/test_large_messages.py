"""Requests and streamed responses larger than a worker pipe holds: refused at the limits, or served whole, and
the model keeps serving either way (issue 34: a half-written control message wedged a model for good)."""

from __future__ import annotations

import json
import queue
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from geserve.core import limits
from tests.support import GeserveProcess, copy_model

pytestmark = pytest.mark.e2e

MODELS = Path(__file__).resolve().parents[1] / "python_models"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GeserveProcess]:
    root = tmp_path_factory.mktemp("large")
    repository = root / "models"
    for name in ("echo_parameters", "streams_text"):
        shutil.copytree(MODELS / name, repository / name)
    copy_model("simple_sequence", repository)
    process = GeserveProcess(root / "geserve.log", f"--model-repository={repository}").wait_live()
    yield process
    assert process.stop() == 0, process.log()
    assert "Traceback" not in process.log()


def _infer_one(server: GeserveProcess, protocol: str, model: str, name: str, value: np.ndarray, **options: Any) -> Any:
    """One request with a fresh client, closed after it."""
    if protocol == "http":
        client: Any = httpclient.InferenceServerClient(server.url, network_timeout=60.0)
        tensor: Any = httpclient.InferInput(name, list(value.shape), "INT32")
    else:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        tensor = grpcclient.InferInput(name, list(value.shape), "INT32")
        options["client_timeout"] = 60.0
    tensor.set_data_from_numpy(value)
    try:
        return client.infer(model, [tensor], **options)
    finally:
        client.close()


def _infer(server: GeserveProcess, protocol: str, **options: Any) -> Any:
    return _infer_one(server, protocol, "echo_parameters", "IN", np.array([1], dtype=np.int32), **options)


def _served(server: GeserveProcess, protocol: str) -> None:
    """A good request to the same model right after: answered."""
    result = _infer(server, protocol, request_id="good", parameters={"mode": "fast"})
    assert json.loads(result.as_numpy("PARAMETERS")[0]) == {"mode": "fast"}


def _refused(server: GeserveProcess, protocol: str, match: str, http_status: str = "400", **options: Any) -> None:
    with pytest.raises(InferenceServerException) as raised:
        _infer(server, protocol, **options)
    if protocol == "http":
        assert raised.value.status() == http_status
    else:
        assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert match in str(raised.value.message())
    assert len(str(raised.value.message())) < 1000  # the id is not repeated back
    _served(server, protocol)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_10_mib_request_id_is_refused_naming_the_limit(server: GeserveProcess, protocol: str) -> None:
    if protocol == "http":  # its JSON is past --http-max-json-size before the id is read: 413, naming that flag
        _refused(server, protocol, "--http-max-json-size", http_status="413", request_id="i" * (10 << 20))
    else:
        _refused(server, protocol, f"limit of {limits.MAX_REQUEST_ID_BYTES} bytes", request_id="i" * (10 << 20))


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_100k_parameters_are_refused_naming_the_limit(server: GeserveProcess, protocol: str) -> None:
    parameters = {f"key_{index:06d}": index for index in range(100_000)}
    _refused(server, protocol, f"limit of {limits.MAX_PARAMETERS} parameters", parameters=parameters)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_400_kb_sequence_id_is_refused_naming_the_limit(server: GeserveProcess, protocol: str) -> None:
    value = np.array([[3]], dtype=np.int32)
    flags = {"sequence_start": True, "sequence_end": True}
    with pytest.raises(InferenceServerException, match=f"limit of {limits.MAX_SEQUENCE_ID_BYTES} bytes"):
        _infer_one(server, protocol, "simple_sequence", "INPUT", value, sequence_id="s" * 400_000, **flags)
    result = _infer_one(server, protocol, "simple_sequence", "INPUT", value, sequence_id="short", **flags)
    assert result.as_numpy("OUTPUT").tolist() == [[4]]  # READY * (INPUT + START)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_parameters_larger_than_the_pipe_buffer_within_the_limits_are_served_whole(
    server: GeserveProcess, protocol: str
) -> None:
    # ~900 KiB of parameters and an 8 KiB id: several times what the worker's pipe holds, all within the limits.
    parameters = {f"key_{index:04d}": "v" * 900 for index in range(limits.MAX_PARAMETERS - 8)}
    request_id = "r" * limits.MAX_REQUEST_ID_BYTES
    for _ in range(3):
        result = _infer(server, protocol, request_id=request_id, parameters=parameters)
        assert json.loads(result.as_numpy("PARAMETERS")[0]) == parameters
        assert result.as_numpy("REQUEST_ID")[0] == request_id.encode()
    _served(server, protocol)


def test_a_decoupled_model_streams_1_mib_strings_and_stays_available(server: GeserveProcess) -> None:
    responses: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        for size in [1 << 20] * 5 + [5]:
            tensor = grpcclient.InferInput("SIZE", [1], "INT32")
            tensor.set_data_from_numpy(np.array([size], dtype=np.int32))
            client.async_stream_infer("streams_text", [tensor], enable_empty_final_response=True)
            result, error = responses.get(timeout=60)
            assert error is None, error
            assert result.as_numpy("TEXT").tolist() == [b"t" * size]
            final, error = responses.get(timeout=60)
            assert error is None and final.get_response().parameters["triton_final_response"].bool_param
        client.stop_stream()
        assert client.is_model_ready("streams_text")
    finally:
        client.close()
    _served(server, "grpc")
