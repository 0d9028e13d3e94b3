"""ModelInferRequest split once: raw contents as views of the received bytes, everything else as protobuf parses it."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf.message import DecodeError

from geserve._generated import grpc_service_pb2 as pb
from geserve.grpc.decoding import Undecodable, _lenient
from geserve.grpc.raw import InferReply, parse_infer_request, serialize_infer_reply


def _request(raw: list[bytes]) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name="resnet50", model_version="1", id="request-7")
    message.parameters["priority"].int64_param = 2
    for index, _ in enumerate(raw):
        tensor = message.inputs.add(name=f"INPUT{index}", datatype="FP32", shape=[1, 4])
        tensor.parameters["binary_data_size"].int64_param = 16
    message.outputs.add(name="OUTPUT0")
    message.raw_input_contents.extend(raw)
    return message


def test_raw_contents_are_views_of_the_received_bytes_and_the_rest_parses_as_protobuf_does() -> None:
    raw = [np.arange(4, dtype=np.float32).tobytes(), b"\x00" * 300, b""]
    original = _request(raw)
    data = original.SerializeToString()
    parsed = parse_infer_request(data)
    assert [bytes(view) for view in parsed.raw_input_contents] == raw
    assert all(view.obj is data for view in parsed.raw_input_contents)  # not copied
    without_raw = pb.ModelInferRequest()
    without_raw.CopyFrom(original)
    del without_raw.raw_input_contents[:]
    assert parsed.message == without_raw
    assert not parsed.message.raw_input_contents


def test_a_request_without_raw_contents_is_parsed_whole() -> None:
    original = pb.ModelInferRequest(model_name="simple")
    original.inputs.add(name="INPUT0", datatype="INT32", shape=[1, 2]).contents.int_contents.extend([1, 2])
    parsed = parse_infer_request(original.SerializeToString())
    assert parsed.message == original and parsed.raw_input_contents == ()


@pytest.mark.parametrize(
    "data",
    [
        _request([b"abcd"]).SerializeToString()[:-2],  # truncated inside the raw entry
        b"\x0a\xff",  # a length past the end
        b"\x0b",  # wire type 3 (groups)
        b"\x08" + b"\xff" * 11,  # a varint that never ends
    ],
)
def test_bytes_that_are_not_a_message_are_refused(data: bytes) -> None:
    with pytest.raises(DecodeError):
        parse_infer_request(data)
    refused = _lenient(pb.ModelInferRequest, parse_infer_request)(data)
    assert isinstance(refused, Undecodable)
    assert refused.message.startswith("unable to parse the request as inference.ModelInferRequest")


@pytest.mark.parametrize("sizes", [[], [0], [16, 300, 0], [200_000, 3]])
def test_a_reply_serialized_beside_its_raw_outputs_parses_as_the_whole_message(sizes: list[int]) -> None:
    outputs = [np.arange(size, dtype=np.uint8) for size in sizes]
    message = pb.ModelInferResponse(model_name="simple", model_version="1", id="request-7")
    message.parameters["sequence_id"].int64_param = 9
    for index, output in enumerate(outputs):
        message.outputs.add(name=f"OUTPUT{index}", datatype="UINT8", shape=[output.size])
    reply = InferReply(message, tuple(output.data.cast("B") for output in outputs))
    expected = pb.ModelInferResponse()
    expected.CopyFrom(message)
    expected.raw_output_contents.extend(output.tobytes() for output in outputs)
    parsed = pb.ModelInferResponse.FromString(serialize_infer_reply(reply))
    assert parsed == expected == reply.to_message()
    assert serialize_infer_reply(expected) == expected.SerializeToString()
