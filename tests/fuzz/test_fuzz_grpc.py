"""gRPC under fuzzed messages: mutated valid requests and random bytes through a raw channel."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2

from tests.support import GeserveProcess

# What a fuzzed request may get: an answer or a refusal that blames the request, never a server fault.
ACCEPTABLE = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}


def _valid_request() -> bytes:
    request = service_pb2.ModelInferRequest(model_name="simple", id="fuzz")
    for name in ("INPUT0", "INPUT1"):
        tensor = request.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        tensor.contents.int_contents.extend(range(16))
    request.outputs.add(name="OUTPUT0")
    return request.SerializeToString()


VALID = _valid_request()


@pytest.fixture(scope="module")
def channel(fuzz_server: GeserveProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{fuzz_server.grpc_port}") as opened:
        yield opened


def _infer(channel: grpc.Channel, data: bytes) -> grpc.StatusCode:
    call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
    try:
        call(data, timeout=30)
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def _good_request(channel: grpc.Channel) -> None:
    call = channel.unary_unary(
        "/inference.GRPCInferenceService/ModelInfer", response_deserializer=service_pb2.ModelInferResponse.FromString
    )
    response = call(VALID, timeout=30)
    values = np.frombuffer(response.raw_output_contents[0], dtype=np.int32)
    np.testing.assert_array_equal(values, np.arange(16) * 2)


@given(st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), min_size=1, max_size=8))
def test_mutated_valid_requests(channel: grpc.Channel, edits: list[tuple[int, int]]) -> None:
    data = bytearray(VALID)
    for position, value in edits:
        data[position] = value
    assert _infer(channel, bytes(data)) in ACCEPTABLE
    _good_request(channel)


@given(st.integers(0, len(VALID)))
def test_truncated_requests(channel: grpc.Channel, length: int) -> None:
    assert _infer(channel, VALID[:length]) in ACCEPTABLE
    _good_request(channel)


@given(st.binary(max_size=512))
def test_random_bytes(channel: grpc.Channel, data: bytes) -> None:
    assert _infer(channel, data) in ACCEPTABLE
