"""Python models written for Triton's python backend, served by a real geserve and used through tritonclient."""

from __future__ import annotations

import asyncio
import json
import queue
import re
import shutil
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcclient_aio
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.support import GeserveProcess, copy_model

pytestmark = [pytest.mark.e2e, pytest.mark.one_layout]

MODELS = Path(__file__).resolve().parents[1] / "python_models"


@pytest.fixture(scope="module")
def python_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GeserveProcess]:
    root = tmp_path_factory.mktemp("python")
    repository = root / "models"
    shutil.copytree(MODELS, repository, ignore=shutil.ignore_patterns("README.md", "__pycache__"))
    gated = repository / "gated" / "config.pbtxt"
    gated.write_text(gated.read_text().replace("READY_FILE", str(root / "ready")))
    for name in ("simple_identity", "repeat_int32"):
        copy_model(name, repository)
    process = GeserveProcess(
        root / "geserve.log",
        f"--model-repository={repository}",
        "--exit-on-error=false",
        "--metrics-interval-ms=100",
    ).wait_live()
    yield process
    assert process.stop() == 0, process.log()


def _http(server: GeserveProcess) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.url)


def _grpc(server: GeserveProcess) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")


def _http_input(name: str, array: np.ndarray, datatype: str) -> httpclient.InferInput:
    tensor = httpclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=True)
    return tensor


def _grpc_input(name: str, array: np.ndarray, datatype: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def _one(server: GeserveProcess, model: str, value: int) -> np.ndarray:
    result = _http(server).infer(model, [_http_input("IN", np.array([value], dtype=np.int32), "INT32")])
    return np.asarray(result.as_numpy("OUT"))


# -- models written for Triton run unchanged --------------------------------------------------------


def test_triton_add_sub_example_runs_unchanged(python_server: GeserveProcess) -> None:
    a = np.array([1.5, 2.0, -3.0, 4.25], dtype=np.float32)
    b = np.array([0.5, 8.0, 1.0, -0.25], dtype=np.float32)
    result = _http(python_server).infer("add_sub", [_http_input("INPUT0", a, "FP32"), _http_input("INPUT1", b, "FP32")])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    result = _grpc(python_server).infer("add_sub", [_grpc_input("INPUT0", a, "FP32"), _grpc_input("INPUT1", b, "FP32")])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    assert _http(python_server).get_model_config("add_sub")["backend"] == "python"


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_simple_identity_round_trips_non_ascii_and_nul_bytes(python_server: GeserveProcess, protocol: str) -> None:
    data = np.array([["π≈3.14".encode(), b"nul\x00inside", b"", b"\xff\xfe raw"]], dtype=np.object_)
    if protocol == "http":
        result: Any = _http(python_server).infer("simple_identity", [_http_input("INPUT0", data, "BYTES")])
    else:
        result = _grpc(python_server).infer("simple_identity", [_grpc_input("INPUT0", data, "BYTES")])
    assert result.as_numpy("OUTPUT0").tolist() == data.tolist()


def test_config_completed_by_auto_complete_config(python_server: GeserveProcess) -> None:
    config = _http(python_server).get_model_config("auto_double")
    assert config["backend"] == "python"
    assert config["max_batch_size"] == 4
    assert "dynamic_batching" in config
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == [("X", "TYPE_INT64", [3])]
    x = np.array([[1, -2, 3], [4, 5, 6]], dtype=np.int64)
    result = _http(python_server).infer("auto_double", [_http_input("X", x, "INT64")])
    np.testing.assert_array_equal(result.as_numpy("Y"), x * 2)


def test_model_reads_custom_parameters_request_id_and_initialize_args(python_server: GeserveProcess) -> None:
    client = _http(python_server)
    result = client.infer(
        "echo_parameters",
        [_http_input("IN", np.array([1], dtype=np.int32), "INT32")],
        request_id="req-7",
        parameters={"temperature": 0.5, "mode": "fast", "top_k": 3, "greedy": True},
    )
    assert json.loads(result.as_numpy("PARAMETERS")[0]) == {
        "temperature": 0.5,
        "mode": "fast",
        "top_k": 3,
        "greedy": True,
    }
    assert result.as_numpy("REQUEST_ID")[0] == b"req-7"
    args = json.loads(result.as_numpy("ARGS")[0])
    assert args["model_name"] == "echo_parameters"
    assert args["model_version"] == "1"
    assert args["model_instance_kind"] == "CPU"
    assert args["model_instance_device_id"] == "0"
    assert args["model_instance_name"].startswith("echo_parameters")
    assert Path(args["model_repository"]).name == "echo_parameters"
    grpc_result = _grpc(python_server).infer(
        "echo_parameters", [_grpc_input("IN", np.array([1], dtype=np.int32), "INT32")], parameters={"mode": "slow"}
    )
    assert json.loads(grpc_result.as_numpy("PARAMETERS")[0]) == {"mode": "slow"}


def test_batched_requests_are_answered_one_by_one(python_server: GeserveProcess) -> None:
    inputs = [np.full((1 + index % 3, 2), index, dtype=np.float32) for index in range(24)]
    inputs[5] = -inputs[5] - 1  # this request alone fails

    async def run() -> list[Any]:
        client = grpcclient_aio.InferenceServerClient(f"127.0.0.1:{python_server.grpc_port}")
        try:

            async def one(x: np.ndarray) -> Any:
                tensor = grpcclient_aio.InferInput("X", list(x.shape), "FP32")
                tensor.set_data_from_numpy(x)
                try:
                    return await client.infer("batched_rows", [tensor])
                except InferenceServerException as error:
                    return error

            return await asyncio.gather(*(one(x) for x in inputs))
        finally:
            await client.close()

    results = asyncio.run(run())
    batch_sizes = []
    for index, (x, result) in enumerate(zip(inputs, results, strict=True)):
        if index == 5:
            assert isinstance(result, InferenceServerException)
            assert result.status() == "StatusCode.INVALID_ARGUMENT"
            assert "negative values are not allowed" in result.message()
            continue
        assert not isinstance(result, InferenceServerException), result
        np.testing.assert_array_equal(result.as_numpy("Y"), x * 10)
        assert result.as_numpy("BATCH").shape == (x.shape[0], 1)
        batch_sizes.append(int(result.as_numpy("BATCH")[0, 0]))
    assert max(batch_sizes) > 1  # execute got several requests at once


def test_async_execute(python_server: GeserveProcess) -> None:
    np.testing.assert_array_equal(_one(python_server, "async_echo", 5), [105])


# -- user errors in model.py ------------------------------------------------------------------------


def test_load_errors_name_the_last_traceback_line(python_server: GeserveProcess) -> None:
    client = _http(python_server)
    assert not client.is_model_ready("import_error")
    assert not client.is_model_ready("init_error")
    log = python_server.log()
    assert re.search(r"import_error.*ModuleNotFoundError: No module named 'not_a_module'", log)
    assert "model 'init_error': initialize failed: ValueError: the weights file is missing" in log
    np.testing.assert_array_equal(_one(python_server, "raises", 1), [1])  # the server serves on


def test_wrong_return_and_raising_execute_fail_the_request_not_the_server(python_server: GeserveProcess) -> None:
    client = _http(python_server)
    with pytest.raises(InferenceServerException) as error:
        client.infer("wrong_return", [_http_input("IN", np.array([1], dtype=np.int32), "INT32")])
    assert error.value.status() == "500"
    assert (
        "Failed to process the request(s) for model 'wrong_return_0', message: Number of InferenceResponse objects do "
        "not match the number of InferenceRequest objects. InferenceRequest(s) size is:1, and InferenceResponse(s) "
        "size is:InferenceResponse"
    ) in error.value.message()
    np.testing.assert_array_equal(_one(python_server, "raises", 2), [2])
    with pytest.raises(InferenceServerException) as error:
        _one(python_server, "raises", 13)
    assert error.value.status() == "500"
    message = error.value.message()
    assert message.startswith(
        "Failed to process the request(s) for model 'raises_0', message: RuntimeError: unlucky input\n\nAt:\n"
    ), message
    assert re.search(r"raises/1/model\.py\(\d+\): execute", message), message
    np.testing.assert_array_equal(_one(python_server, "raises", 3), [3])
    with pytest.raises(InferenceServerException):
        _grpc(python_server).infer("raises", [_grpc_input("IN", np.array([13], dtype=np.int32), "INT32")])
    np.testing.assert_array_equal(_one(python_server, "raises", 4), [4])


# -- readiness, logging and custom metrics ----------------------------------------------------------


def test_is_ready_drives_model_readiness(python_server: GeserveProcess) -> None:
    client = _http(python_server)
    ready_file = python_server.log_path.parent / "ready"

    def wait_for(expected: bool) -> None:
        deadline = time.monotonic() + 20
        while client.is_model_ready("gated") != expected:
            assert time.monotonic() < deadline, f"gated never became {'ready' if expected else 'unready'}"
            time.sleep(0.1)

    wait_for(False)
    ready_file.write_text("")
    wait_for(True)
    assert _grpc(python_server).is_model_ready("gated")
    ready_file.unlink()
    wait_for(False)


def test_custom_metrics_and_logger(python_server: GeserveProcess) -> None:
    for value in (5, 50, 7):
        _one(python_server, "counted", value)
    url = f"http://127.0.0.1:{python_server.metrics_port}/metrics"
    deadline = time.monotonic() + 20
    while True:
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        if 'counted_requests_total{kind="all",model="counted"} 3' in text:
            break
        assert time.monotonic() < deadline, text
        time.sleep(0.1)
    assert "# TYPE counted_requests_total counter" in text
    assert 'counted_last_value{model="counted"} 7' in text
    assert 'counted_value_bucket{model="counted",le="1"} 0' in text
    assert 'counted_value_bucket{model="counted",le="10"} 2' in text
    assert 'counted_value_bucket{model="counted",le="+Inf"} 3' in text
    assert 'counted_value_count{model="counted"} 3' in text
    assert "counted is initialized" in python_server.log()


# -- decoupled models -------------------------------------------------------------------------------


def _repeat_inputs(values: list[int], delays: list[int], wait: int = 0) -> list[grpcclient.InferInput]:
    return [
        _grpc_input("IN", np.array(values, dtype=np.int32), "INT32"),
        _grpc_input("DELAY", np.array(delays, dtype=np.uint32), "UINT32"),
        _grpc_input("WAIT", np.array([wait], dtype=np.uint32), "UINT32"),
    ]


def _stream(
    server: GeserveProcess,
    requests: list[tuple[str, list[grpcclient.InferInput]]],
    empty_final: bool,
    expected: int = 0,
) -> list[Any]:
    """Send the requests on one stream; collect until every request saw its final response (or, without
    empty final responses, until `expected` messages came)."""
    client = _grpc(server)
    received: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: received.put((result, error)))
    try:
        for request_id, inputs in requests:
            client.async_stream_infer(
                "repeat_int32", inputs, request_id=request_id, enable_empty_final_response=empty_final
            )
        items: list[Any] = []
        open_requests = {request_id for request_id, _ in requests}
        deadline = time.monotonic() + 20
        while (open_requests if empty_final else len(items) < expected) and time.monotonic() < deadline:
            try:
                result, error = received.get(timeout=0.5)
            except queue.Empty:
                continue
            items.append(error if error is not None else result)
            if error is None:
                response = result.get_response()
                if empty_final and response.parameters["triton_final_response"].bool_param:
                    open_requests.discard(response.id)
        return items
    finally:
        client.stop_stream()


def test_decoupled_model_streams_each_element_then_an_empty_final_response(python_server: GeserveProcess) -> None:
    items = _stream(
        python_server,
        [("a", _repeat_inputs([4, 5, 6], [20, 5, 5], wait=10)), ("b", _repeat_inputs([7, 8], [1, 1]))],
        empty_final=True,
    )
    by_request: dict[str, list[tuple[Any, Any, bool]]] = {"a": [], "b": []}
    for item in items:
        response = item.get_response()
        final = response.parameters["triton_final_response"].bool_param
        by_request[response.id].append((item.as_numpy("OUT"), item.as_numpy("IDX"), final))
    for request_id, values in (("a", [4, 5, 6]), ("b", [7, 8])):
        answers = by_request[request_id]
        assert [int(out[0]) for out, _, _ in answers[:-1]] == values
        assert [int(idx[0]) for _, idx, _ in answers[:-1]] == list(range(len(values)))
        assert [final for _, _, final in answers] == [False] * len(values) + [True]
        assert answers[-1][0] is None  # the FINAL flag came alone: an empty response carries it


def test_decoupled_without_empty_final_responses(python_server: GeserveProcess) -> None:
    items = _stream(python_server, [("c", _repeat_inputs([1, 2, 3], [0, 0, 0]))], empty_final=False, expected=3)
    assert [int(item.as_numpy("OUT")[0]) for item in items] == [1, 2, 3]
    # Each says it is not the last (as Triton's stream handler does on every response); no empty final follows.
    assert [item.get_response().parameters["triton_final_response"].bool_param for item in items] == [False] * 3


def test_decoupled_model_errors_and_refusals(python_server: GeserveProcess) -> None:
    items = _stream(python_server, [("bad", _repeat_inputs([1, 2], [0]))], empty_final=True)
    assert isinstance(items[0], InferenceServerException)
    assert "expected IN and DELAY shapes to match, got [2] and [1]" in items[0].message()
    with pytest.raises(InferenceServerException) as error:
        _http(python_server).infer(
            "repeat_int32",
            [
                _http_input("IN", np.array([1], dtype=np.int32), "INT32"),
                _http_input("DELAY", np.array([0], dtype=np.uint32), "UINT32"),
                _http_input("WAIT", np.array([0], dtype=np.uint32), "UINT32"),
            ],
        )
    assert error.value.status() == "501"  # UNSUPPORTED
    assert error.value.message() == "HTTP end point doesn't support models with decoupled transaction policy"
    with pytest.raises(InferenceServerException) as error:
        _grpc(python_server).infer("repeat_int32", _repeat_inputs([1], [0]))
    assert "ModelInfer RPC doesn't support models with decoupled transaction policy" in error.value.message()
    items = _stream(python_server, [("ok", _repeat_inputs([9], [0]))], empty_final=True)
    assert int(items[0].as_numpy("OUT")[0]) == 9


def test_decoupled_stream_over_asyncio_client(python_server: GeserveProcess) -> None:
    async def run() -> list[int]:
        client = grpcclient_aio.InferenceServerClient(f"127.0.0.1:{python_server.grpc_port}")
        try:

            async def requests() -> Any:
                inputs = []
                for name, array, datatype in (
                    ("IN", np.array([10, 20, 30, 40], dtype=np.int32), "INT32"),
                    ("DELAY", np.array([1, 1, 1, 1], dtype=np.uint32), "UINT32"),
                    ("WAIT", np.array([0], dtype=np.uint32), "UINT32"),
                ):
                    tensor = grpcclient_aio.InferInput(name, list(array.shape), datatype)
                    tensor.set_data_from_numpy(array)
                    inputs.append(tensor)
                yield {
                    "model_name": "repeat_int32",
                    "inputs": inputs,
                    "request_id": "async",
                    "enable_empty_final_response": True,
                }

            values = []
            async for result, error in client.stream_infer(requests()):
                assert error is None, error
                response = result.get_response()
                if response.parameters["triton_final_response"].bool_param:
                    break
                values.append(int(result.as_numpy("OUT")[0]))
            return values
        finally:
            await client.close()

    assert asyncio.run(run()) == [10, 20, 30, 40]


def test_a_stream_the_client_cancels_is_cancelled_in_the_model(python_server: GeserveProcess) -> None:
    client = _grpc(python_server)
    http = httpclient.InferenceServerClient(python_server.url)

    def outcomes() -> tuple[int, int]:
        stats = http.get_inference_statistics("cancellable")["model_stats"][0]["inference_stats"]
        return stats["success"]["count"], stats["fail"]["count"]

    before = outcomes()
    log_before = len(python_server.log())
    received: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: received.put(error or result))
    count = _grpc_input("COUNT", np.array([500], dtype=np.int32), "INT32")
    client.async_stream_infer("cancellable", [count], request_id="goes-away")
    for _ in range(3):
        received.get(timeout=10)
    client.stop_stream(cancel_requests=True)
    deadline = time.monotonic() + 10
    while "request goes-away cancelled after" not in python_server.log():
        assert time.monotonic() < deadline, "the model never saw the cancellation"
        time.sleep(0.1)
    sent = int(re.search(r"request goes-away cancelled after (\d+) responses", python_server.log()).group(1))
    assert 3 <= sent < 500
    assert outcomes() == (before[0], before[1] + 1)  # a failure, as Triton counts a cancelled request
    with urllib.request.urlopen(f"http://127.0.0.1:{python_server.metrics_port}/metrics", timeout=10) as response:
        metrics = response.read().decode()
    assert re.search(
        r'nv_inference_request_failure\{model="cancellable",reason="CANCELED",version="1"\} [1-9]', metrics
    )
    assert "Traceback" not in python_server.log()[log_before:]  # a cancelled stream is routine, not an error


def test_streams_cancelled_mid_response_leave_no_traceback(python_server: GeserveProcess) -> None:
    """Calls cancelled while the server is writing responses: routine for gRPC, never a library traceback."""
    log_before = len(python_server.log())

    async def run() -> None:
        client = grpcclient_aio.InferenceServerClient(f"127.0.0.1:{python_server.grpc_port}")
        try:
            for attempt in range(20):

                async def requests(request_id: str) -> Any:
                    count = _grpc_input("COUNT", np.array([500], dtype=np.int32), "INT32")
                    yield {"model_name": "cancellable", "inputs": [count], "request_id": request_id}
                    await asyncio.sleep(30)  # keep the request side open: the cancel ends the call

                stream = client.stream_infer(requests(f"cut-{attempt}"))
                received = 0
                async for _, error in stream:
                    assert error is None, error
                    received += 1
                    if received == 1 + attempt % 3:
                        break
                stream.cancel()
                await asyncio.sleep(0.02 * (attempt % 3))
        finally:
            await client.close()

    asyncio.run(run())
    assert _one(python_server, "async_echo", 7).tolist() == [107]
    assert "Traceback" not in python_server.log()[log_before:]
