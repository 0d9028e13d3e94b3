"""A unary request whose client goes away while a python model runs it is cancelled in the model (is_cancelled)."""

from __future__ import annotations

import asyncio
import json
import queue
import re
import shutil
import time
import urllib.request
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcclient_aio
import tritonclient.http as httpclient
import tritonclient.http.aio as httpclient_aio
from tritonclient.utils import InferenceServerException

from tests.support import GeserveProcess, config_text, connect_http

pytestmark = pytest.mark.e2e

MODELS = Path(__file__).resolve().parents[1] / "python_models"
MODEL = "holds_until_cancelled"
BATCHED = "holds_until_cancelled_batched"
# The batched variant: two requests always share a batch (never sent alone by the queue delay).
BATCHED_CONFIG = config_text(
    BATCHED,
    backend="python",
    max_batch_size=2,
    inputs=[("HOLD", "TYPE_INT32", "1")],
    outputs=[("OUT", "TYPE_INT32", "1")],
    extra="dynamic_batching { preferred_batch_size: [ 2 ] max_queue_delay_microseconds: 60000000 }",
)
# How long a test waits for what the model logs: it only gets there through the cancellation.
WAIT_S = 30.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GeserveProcess]:
    root = tmp_path_factory.mktemp("cancellation")
    repository = root / "models"
    shutil.copytree(MODELS / MODEL, repository / MODEL)
    batched = shutil.copytree(MODELS / MODEL, repository / BATCHED)
    (batched / "config.pbtxt").write_text(BATCHED_CONFIG)
    process = GeserveProcess(root / "geserve.log", f"--model-repository={repository}").wait_live()
    yield process
    assert process.stop() == 0, process.log()


def _grpc(server: GeserveProcess) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")


def _hold(value: int, batched: bool = False) -> grpcclient.InferInput:
    array = np.array([[value]] if batched else [value], dtype=np.int32)
    tensor = grpcclient.InferInput("HOLD", list(array.shape), "INT32")
    tensor.set_data_from_numpy(array)
    return tensor


def _http_hold(value: int) -> httpclient.InferInput:
    tensor = httpclient.InferInput("HOLD", [1], "INT32")
    tensor.set_data_from_numpy(np.array([value], dtype=np.int32))
    return tensor


def _logged(server: GeserveProcess, line: str) -> bool:
    return f"request {line}" in server.log()


def _wait_logged(server: GeserveProcess, line: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not _logged(server, line):
        assert time.monotonic() < deadline, f"the model never logged 'request {line}':\n{server.log()}"
        time.sleep(0.02)


async def _wait_logged_async(server: GeserveProcess, line: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not _logged(server, line):
        assert time.monotonic() < deadline, f"the model never logged 'request {line}':\n{server.log()}"
        await asyncio.sleep(0.02)


async def _cancel_once_running(server: GeserveProcess, call: Coroutine[Any, Any, Any], request_id: str) -> None:
    """Run `call`, the request `request_id`, and cancel it once the model logs it running: the model logs it
    cancelled."""
    task = asyncio.create_task(call)
    await _wait_logged_async(server, f"{request_id} running")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _wait_logged_async(server, f"{request_id} cancelled")


def _outcomes(server: GeserveProcess, model: str = MODEL) -> tuple[int, int, int]:
    """Successes, failures and executions, as the statistics extension counts them."""
    stats = httpclient.InferenceServerClient(server.url).get_inference_statistics(model)["model_stats"][0]
    inference = stats["inference_stats"]
    return inference["success"]["count"], inference["fail"]["count"], stats["execution_count"]


def _cancelled_metric(server: GeserveProcess, model: str = MODEL) -> int:
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    pattern = rf'nv_inference_request_failure\{{model="{model}",reason="CANCELED",version="1"\}} (\d+)'
    found = re.search(pattern, text)
    assert found is not None, text
    return int(found.group(1))


def _good_request_succeeds(server: GeserveProcess, request_id: str) -> None:
    """A request right after: answered, and never told it was cancelled."""
    result = httpclient.InferenceServerClient(server.url).infer(MODEL, [_http_hold(0)], request_id=request_id)
    assert result.as_numpy("OUT").tolist() == [0]
    assert _logged(server, f"{request_id} answered")


def test_a_grpc_cancel_reaches_the_running_model(server: GeserveProcess) -> None:
    before, cancelled_before = _outcomes(server), _cancelled_metric(server)
    answers: queue.Queue[Any] = queue.Queue()
    handle = _grpc(server).async_infer(
        MODEL, [_hold(1)], callback=lambda result, error: answers.put(error or result), request_id="grpc-cancel"
    )
    _wait_logged(server, "grpc-cancel running")
    handle.cancel()
    answer = answers.get(timeout=WAIT_S)
    assert isinstance(answer, InferenceServerException)
    assert answer.status() == "StatusCode.CANCELLED"
    _wait_logged(server, "grpc-cancel cancelled")
    _good_request_succeeds(server, "after-grpc-cancel")
    # The cancelled request is one CANCELED failure, whatever the model answered for it.
    assert _outcomes(server)[:2] == (before[0] + 1, before[1] + 1)
    assert _cancelled_metric(server) == cancelled_before + 1


def test_a_grpc_deadline_reaches_the_running_model(server: GeserveProcess) -> None:
    before = _outcomes(server)
    with pytest.raises(InferenceServerException) as error:
        _grpc(server).infer(MODEL, [_hold(1)], request_id="grpc-deadline", client_timeout=2.0)
    assert error.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    _wait_logged(server, "grpc-deadline cancelled")
    _good_request_succeeds(server, "after-grpc-deadline")
    assert _outcomes(server)[:2] == (before[0] + 1, before[1] + 1)


def test_an_asyncio_grpc_call_cancelled_reaches_the_running_model(server: GeserveProcess) -> None:
    before = _outcomes(server)

    async def run() -> None:
        client = grpcclient_aio.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        try:
            call = client.infer(MODEL, [_hold(1)], request_id="aio-grpc-cancel")
            await _cancel_once_running(server, call, "aio-grpc-cancel")
            result = await client.infer(MODEL, [_hold(0)], request_id="after-aio-grpc-cancel")
            assert result.as_numpy("OUT").tolist() == [0]
        finally:
            await client.close()

    asyncio.run(run())
    assert _outcomes(server)[:2] == (before[0] + 1, before[1] + 1)


def test_an_http_client_that_disconnects_cancels_the_running_model(server: GeserveProcess) -> None:
    before = _outcomes(server)
    body = json.dumps(
        {"id": "http-gone", "inputs": [{"name": "HOLD", "shape": [1], "datatype": "INT32", "data": [1]}]}
    ).encode()
    head = (
        f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: geserve\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    sock = connect_http(server)
    sock.sendall(head.encode() + body)
    _wait_logged(server, "http-gone running")
    sock.close()
    _wait_logged(server, "http-gone cancelled")
    _good_request_succeeds(server, "after-http-gone")
    assert _outcomes(server)[:2] == (before[0] + 1, before[1] + 1)


def test_an_asyncio_http_request_cancelled_reaches_the_running_model(server: GeserveProcess) -> None:
    before = _outcomes(server)

    async def run() -> None:
        client = httpclient_aio.InferenceServerClient(server.url)
        try:
            tensor = httpclient_aio.InferInput("HOLD", [1], "INT32")
            tensor.set_data_from_numpy(np.array([1], dtype=np.int32))
            call = client.infer(MODEL, [tensor], request_id="aio-http-cancel")
            # Cancelled, the client closes the connection of a request it no longer waits for.
            await _cancel_once_running(server, call, "aio-http-cancel")
        finally:
            await client.close()

    asyncio.run(run())
    _good_request_succeeds(server, "after-aio-http-cancel")
    assert _outcomes(server)[:2] == (before[0] + 1, before[1] + 1)


def test_only_the_cancelled_request_of_a_batch_is_cancelled(server: GeserveProcess) -> None:
    before = _outcomes(server, BATCHED)
    client = _grpc(server)
    gone: queue.Queue[Any] = queue.Queue()
    stays: queue.Queue[Any] = queue.Queue()
    handle = client.async_infer(
        BATCHED, [_hold(1, True)], callback=lambda result, error: gone.put(error or result), request_id="batch-gone"
    )
    client.async_infer(
        BATCHED, [_hold(0, True)], callback=lambda result, error: stays.put(error or result), request_id="batch-stays"
    )
    _wait_logged(server, "batch-gone running")
    _wait_logged(server, "batch-stays running")
    handle.cancel()
    answer = stays.get(timeout=WAIT_S)  # it waits in the model until the other one is cancelled
    assert not isinstance(answer, InferenceServerException), answer
    assert answer.as_numpy("OUT").tolist() == [[0]]
    assert _logged(server, "batch-gone cancelled")
    assert _logged(server, "batch-stays answered")
    assert gone.get(timeout=WAIT_S).status() == "StatusCode.CANCELLED"
    assert _outcomes(server, BATCHED) == (before[0] + 1, before[1] + 1, before[2] + 1)  # one batch of both
