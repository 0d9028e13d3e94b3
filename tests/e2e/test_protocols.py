"""The same cases through tritonclient HTTP (sync, asyncio) and gRPC (sync, asyncio, streaming):
identical results and identical error texts, each bad request followed by a good one."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aiogrpcclient
import tritonclient.http as httpclient
import tritonclient.http.aio as aiohttpclient
from tritonclient.utils import InferenceServerException

from tests.support import GeserveProcess

pytestmark = pytest.mark.e2e

PROTOCOLS = ["http", "http-aio", "grpc", "grpc-aio", "grpc-stream"]

# Status each client reports for an error code; a stream error carries only its message.
STATUS = {
    "http": {"INVALID_ARG": "400", "NOT_FOUND": "404", "INTERNAL": "500", "UNSUPPORTED": "501"},
    "grpc": {
        "INVALID_ARG": "StatusCode.INVALID_ARGUMENT",
        "NOT_FOUND": "StatusCode.NOT_FOUND",
        "INTERNAL": "StatusCode.INTERNAL",
        "UNSUPPORTED": "StatusCode.UNIMPLEMENTED",
    },
}


@dataclass
class Tensor:
    name: str
    data: np.ndarray
    datatype: str
    shape: list[int] | None = None  # declared shape, when it must differ from the data's


@dataclass
class Call:
    model: str
    inputs: list[Tensor]
    outputs: list[str] | None = None
    request_id: str = ""
    version: str = ""
    class_count: int = 0


@dataclass
class Answer:
    id: str
    outputs: dict[str, np.ndarray] = field(default_factory=dict)


class CallError(Exception):
    def __init__(self, status: str | None, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _build(module: Any, call: Call) -> tuple[list[Any], list[Any] | None]:
    inputs = []
    for tensor in call.inputs:
        item = module.InferInput(tensor.name, list(tensor.data.shape), tensor.datatype)
        item.set_data_from_numpy(tensor.data)
        if tensor.shape is not None:
            item.set_shape(tensor.shape)
        inputs.append(item)
    outputs = None
    if call.outputs is not None:
        outputs = [module.InferRequestedOutput(name, class_count=call.class_count) for name in call.outputs]
    return inputs, outputs


def _answer(result: Any, call: Call, response_id: str) -> Answer:
    names = call.outputs or [o.name if hasattr(o, "name") else o["name"] for o in _outputs(result)]
    return Answer(response_id, {name: result.as_numpy(name) for name in names})


def _outputs(result: Any) -> list[Any]:
    response = result.get_response()
    return list(response.outputs) if hasattr(response, "outputs") else response["outputs"]


def _failure(error: InferenceServerException) -> CallError:
    return CallError(error.status(), error.message())


class Caller:
    """Runs a Call through one client flavour."""

    def __init__(self, protocol: str, server: GeserveProcess) -> None:
        self.protocol = protocol
        self.server = server
        self._stream_client: grpcclient.InferenceServerClient | None = None
        self._stream_answers: queue.Queue[tuple[Any, Any]] = queue.Queue()

    def close(self) -> None:
        if self._stream_client is not None:
            self._stream_client.stop_stream()
            self._stream_client.close()

    def __call__(self, call: Call) -> Answer:
        try:
            return getattr(self, "_" + self.protocol.replace("-", "_"))(call)
        except InferenceServerException as error:
            raise _failure(error) from None

    def _http(self, call: Call) -> Answer:
        client = httpclient.InferenceServerClient(self.server.url)
        inputs, outputs = _build(httpclient, call)
        result = client.infer(call.model, inputs, call.version, outputs, call.request_id)
        return _answer(result, call, result.get_response().get("id", ""))

    def _http_aio(self, call: Call) -> Answer:
        async def run() -> Answer:
            async with aiohttpclient.InferenceServerClient(self.server.url) as client:
                inputs, outputs = _build(aiohttpclient, call)
                result = await client.infer(call.model, inputs, call.version, outputs, call.request_id)
                return _answer(result, call, result.get_response().get("id", ""))

        return asyncio.run(run())

    def _grpc(self, call: Call) -> Answer:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{self.server.grpc_port}")
        inputs, outputs = _build(grpcclient, call)
        result = client.infer(call.model, inputs, call.version, outputs, call.request_id)
        return _answer(result, call, result.get_response().id)

    def _grpc_aio(self, call: Call) -> Answer:
        async def run() -> Answer:
            async with aiogrpcclient.InferenceServerClient(f"127.0.0.1:{self.server.grpc_port}") as client:
                inputs, outputs = _build(aiogrpcclient, call)
                result = await client.infer(call.model, inputs, call.version, outputs, call.request_id)
                return _answer(result, call, result.get_response().id)

        return asyncio.run(run())

    def _grpc_stream(self, call: Call) -> Answer:
        if self._stream_client is None:
            self._stream_client = grpcclient.InferenceServerClient(f"127.0.0.1:{self.server.grpc_port}")
            self._stream_client.start_stream(callback=lambda result, error: self._stream_answers.put((result, error)))
        inputs, outputs = _build(grpcclient, call)
        self._stream_client.async_stream_infer(call.model, inputs, call.version, outputs, call.request_id)
        result, error = self._stream_answers.get(timeout=30)
        if error is not None:
            # Stream errors travel in error_message: the message, with no status.
            raise CallError(None, error.message())
        return _answer(result, call, result.get_response().id)


@pytest.fixture(params=PROTOCOLS)
def caller(request: pytest.FixtureRequest, server: GeserveProcess) -> Iterator[Caller]:
    instance = Caller(request.param, server)
    yield instance
    instance.close()


def ints(*shape: int, start: int = 0) -> np.ndarray:
    return (np.arange(int(np.prod(shape)), dtype=np.int32) + start).reshape(shape)


def strings(values: np.ndarray) -> np.ndarray:
    return np.array([[str(v).encode() for v in row] for row in values], dtype=object)


def simple_call(left: np.ndarray, right: np.ndarray, **kwargs: Any) -> Call:
    return Call("simple", [Tensor("INPUT0", left, "INT32"), Tensor("INPUT1", right, "INT32")], **kwargs)


def assert_good_request(caller: Caller) -> None:
    left, right = ints(2, 16), ints(2, 16, start=100)
    answer = caller(simple_call(left, right, request_id="good"))
    assert answer.id == "good"
    np.testing.assert_array_equal(answer.outputs["OUTPUT0"], left + right)
    np.testing.assert_array_equal(answer.outputs["OUTPUT1"], left - right)


# --------------------------------------------------------------------------------- good requests


def test_simple(caller: Caller) -> None:
    left, right = ints(3, 16), np.full((3, 16), -5, dtype=np.int32)
    answer = caller(simple_call(left, right, outputs=["OUTPUT1", "OUTPUT0"], request_id="abc"))
    assert answer.id == "abc"
    np.testing.assert_array_equal(answer.outputs["OUTPUT0"], left + right)
    np.testing.assert_array_equal(answer.outputs["OUTPUT1"], left - right)
    answer = caller(simple_call(left, right, version="1"))
    np.testing.assert_array_equal(answer.outputs["OUTPUT0"], left + right)


def test_simple_string(caller: Caller) -> None:
    left, right = ints(2, 16), ints(2, 16, start=7)
    call = Call("simple_string", [Tensor("INPUT0", strings(left), "BYTES"), Tensor("INPUT1", strings(right), "BYTES")])
    answer = caller(call)
    assert [int(x) for x in answer.outputs["OUTPUT0"].reshape(-1)] == (left + right).reshape(-1).tolist()
    assert [int(x) for x in answer.outputs["OUTPUT1"].reshape(-1)] == (left - right).reshape(-1).tolist()


def test_digits(caller: Caller) -> None:
    pixels = np.zeros((2, 64), dtype=np.float32)
    pixels[:, 27:29] = 16.0
    answer = caller(Call("digits", [Tensor("pixels", pixels, "FP32")]))
    probabilities = answer.outputs["probabilities"]
    assert probabilities.shape == (2, 10)
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-4)


# ---------------------------------------------------------------------------------- bad requests

GOOD = ints(1, 16)
BAD_CASES: list[tuple[str, Callable[[], Call], str, str]] = [
    (
        "unknown-model",
        lambda: Call("nope", simple_call(GOOD, GOOD).inputs),
        "INVALID_ARG",
        "Request for unknown model: 'nope' is not found",
    ),
    (
        "unknown-version",
        lambda: simple_call(GOOD, GOOD, version="4"),
        "NOT_FOUND",
        "Request for unknown model: 'simple' version 4 is not found",
    ),
    (
        "missing-input-with-id",
        lambda: Call("simple", [Tensor("INPUT0", GOOD, "INT32")], request_id="r9"),
        "INVALID_ARG",
        "[request id: r9] expected 2 inputs but got 1 inputs for model 'simple'. Got input(s) ['INPUT0'], but missing "
        "required input(s) ['INPUT1']. Please provide all required input(s).",
    ),
    (
        "unexpected-input",
        lambda: Call("simple", [*simple_call(GOOD, GOOD).inputs, Tensor("EXTRA", GOOD, "INT32")]),
        "INVALID_ARG",
        "unexpected inference input 'EXTRA' for model 'simple'",
    ),
    (
        "wrong-datatype",
        lambda: Call("simple", [Tensor("INPUT0", GOOD.astype(np.int64), "INT64"), Tensor("INPUT1", GOOD, "INT32")]),
        "INVALID_ARG",
        "inference input 'INPUT0' data-type is 'INT64', but model 'simple' expects 'INT32'",
    ),
    (
        "wrong-shape",
        lambda: simple_call(ints(1, 4), ints(1, 4)),
        "INVALID_ARG",
        "unexpected shape for input 'INPUT0' for model 'simple'. Expected [-1,16], got [1,4]",
    ),
    (
        "batch-too-large",
        lambda: simple_call(ints(9, 16), ints(9, 16)),
        "INVALID_ARG",
        "inference request batch-size must be <= 8 for 'simple'",
    ),
    (
        "batch-mismatch",
        lambda: simple_call(ints(2, 16), ints(3, 16)),
        "INVALID_ARG",
        "input 'INPUT1' batch size does not match other inputs for 'simple'",
    ),
    (
        "byte-size-mismatch",
        lambda: Call("simple", [Tensor("INPUT0", ints(1, 15), "INT32", [1, 16]), Tensor("INPUT1", GOOD, "INT32")]),
        "INVALID_ARG",
        "input byte size mismatch for input 'INPUT0' for model 'simple'. Expected 64, got 60",
    ),
    (
        "bytes-element-count",
        lambda: Call(
            "simple_string",
            [Tensor("INPUT0", strings(ints(1, 15)), "BYTES", [1, 16]), Tensor("INPUT1", strings(GOOD), "BYTES")],
        ),
        "INVALID_ARG",
        "expected 16 string elements for inference input 'INPUT0' for model 'simple_string', got 15",
    ),
    (
        "duplicate-output",
        lambda: simple_call(GOOD, GOOD, outputs=["OUTPUT0", "OUTPUT0"]),
        "INVALID_ARG",
        "output 'OUTPUT0' already exists in request",
    ),
    (
        "unknown-output",
        lambda: simple_call(GOOD, GOOD, outputs=["OUTPUT5"]),
        "INVALID_ARG",
        "unexpected inference output 'OUTPUT5' for model 'simple'",
    ),
    (
        "model-fails-to-execute",
        lambda: Call(
            "simple_string",
            [Tensor("INPUT0", np.full((1, 16), b"x", dtype=object), "BYTES"), Tensor("INPUT1", strings(GOOD), "BYTES")],
        ),
        "INTERNAL",
        "model 'simple_string' failed to execute",
    ),
]


@pytest.mark.parametrize(("case", "make_call", "code", "message"), BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_request_then_good_request(
    caller: Caller, case: str, make_call: Callable[[], Call], code: str, message: str
) -> None:
    with pytest.raises(CallError) as failure:
        caller(make_call())
    if code == "INTERNAL":
        assert failure.value.message.startswith(message)
    else:
        assert failure.value.message == message
    if caller.protocol == "grpc-stream":
        assert failure.value.status is None
    else:
        assert failure.value.status == STATUS[caller.protocol.split("-")[0]][code]
    assert_good_request(caller)
