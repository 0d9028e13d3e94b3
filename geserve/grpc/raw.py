"""ModelInferRequest bytes split once: raw_input_contents as views of the received bytes, the rest parsed."""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import DecodeError

from geserve._generated import grpc_service_pb2 as pb

_RAW_FIELD = pb.ModelInferRequest.DESCRIPTOR.fields_by_name["raw_input_contents"].number
_LENGTH_DELIMITED, _VARINT, _FIXED64, _FIXED32 = 2, 0, 1, 5


@dataclass(frozen=True, slots=True)
class InferMessage:
    """A ModelInferRequest whose raw_input_contents were taken out before parsing: protobuf would copy each
    entry once into the parsed message and again on every access, and they are the request's megabytes."""

    message: pb.ModelInferRequest
    raw_input_contents: tuple[memoryview, ...]


def parse_infer_request(data: bytes) -> InferMessage:
    """Walk the message's top-level fields (tags and lengths only), keep raw_input_contents as views of `data`,
    and let protobuf parse everything else. Raises DecodeError for bytes that are not a message."""
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
        return InferMessage(pb.ModelInferRequest.FromString(data), ())
    rest.append(view[kept_from:])
    return InferMessage(pb.ModelInferRequest.FromString(b"".join(rest)), tuple(raw))


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
