"""ModelInfer's raw tensor bytes kept out of protobuf: request contents as views, response contents joined once."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from geserve._generated import grpc_service_pb2 as pb

_RAW_FIELD = pb.ModelInferRequest.DESCRIPTOR.fields_by_name["raw_input_contents"].number
_LENGTH_DELIMITED, _VARINT, _FIXED64, _FIXED32 = 2, 0, 1, 5
_RAW_OUTPUT_KEY = bytes(
    [pb.ModelInferResponse.DESCRIPTOR.fields_by_name["raw_output_contents"].number << 3 | _LENGTH_DELIMITED]
)


@dataclass(frozen=True, slots=True)
class InferMessage:
    """A ModelInferRequest whose raw_input_contents were taken out before parsing: protobuf would copy each
    entry once into the parsed message and again on every access, and they are the request's megabytes."""

    message: pb.ModelInferRequest
    raw_input_contents: tuple[memoryview, ...]
    received_ns: int = 0  # when its bytes were handed over to be parsed: GRPC_WAITREAD_START, if it is traced
    size: int = 0  # the serialized message's bytes


@dataclass(frozen=True, slots=True)
class InferReply:
    """A ModelInferResponse with its raw_output_contents beside it, not in it: appending them to the message
    would copy each one into bytes, then into the message, then into the serialized reply."""

    message: pb.ModelInferResponse
    raw_output_contents: tuple[bytes | memoryview, ...]
    # A traced reply's: told when its serialization started and ended (GRPC_SEND_START and GRPC_SEND_END).
    sent: Callable[[int, int], None] | None = None

    def to_message(self) -> pb.ModelInferResponse:
        """The whole response as one message (a stream's responses are nested in another)."""
        message = pb.ModelInferResponse()
        message.CopyFrom(self.message)
        message.raw_output_contents.extend(bytes(raw) for raw in self.raw_output_contents)
        return message


def serialize_infer_reply(reply: InferReply | pb.ModelInferResponse) -> bytes:
    """The reply's wire bytes: the message, then each raw output as a field of its own (protobuf appends
    repeated fields in the order they come), so each output's bytes are copied once, into the result."""
    if not isinstance(reply, InferReply):
        return reply.SerializeToString()
    started_ns = time.monotonic_ns() if reply.sent is not None else 0
    parts: list[bytes | memoryview] = [reply.message.SerializeToString()]
    for raw in reply.raw_output_contents:
        parts += (_RAW_OUTPUT_KEY, _encode_varint(memoryview(raw).nbytes), raw)
    wire = b"".join(parts)
    if reply.sent is not None:
        reply.sent(started_ns, time.monotonic_ns())
    return wire


def parse_infer_request(data: bytes) -> InferMessage:
    """Walk the message's top-level fields (tags and lengths only), keep raw_input_contents as views of `data`,
    and let protobuf parse everything else. Raises DecodeError for bytes that are not a message."""
    received_ns = time.monotonic_ns()
    view = memoryview(data)
    rest: list[memoryview] = []
    raw: list[memoryview] = []
    kept_from = position = 0
    size = len(data)
    while position < size:
        key, field_start = _varint(data, position)
        wire_type = key & 7
        if wire_type == _LENGTH_DELIMITED:
            length, body = _varint(data, field_start)
            end = body + length
        elif wire_type == _VARINT:
            end = _varint(data, field_start)[1]
        elif wire_type == _FIXED64:
            end = field_start + 8
        elif wire_type == _FIXED32:
            end = field_start + 4
        else:
            raise DecodeError(f"unsupported wire type {wire_type} at byte {position}")
        if end > size:
            raise DecodeError("truncated message")
        if key >> 3 == _RAW_FIELD and wire_type == _LENGTH_DELIMITED:
            rest.append(view[kept_from:position])
            raw.append(view[body:end])
            kept_from = end
        position = end
    if not raw:
        return InferMessage(pb.ModelInferRequest.FromString(data), (), received_ns, size)
    rest.append(view[kept_from:])
    return InferMessage(pb.ModelInferRequest.FromString(b"".join(rest)), tuple(raw), received_ns, size)


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _varint(data: bytes, position: int) -> tuple[int, int]:
    """The base-128 varint at `position` and the position after it."""
    value = shift = 0
    while True:
        if position >= len(data) or shift > 63:
            raise DecodeError("truncated or overlong varint")
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
        shift += 7
