"""The MODEL_INOUT_INFO partition of an `.om` file: the I/O records `aclmdlGetDesc*` reads on the host."""

# Layout (GE's model_introduction.cc writes it, model_parser_base.cc reads it): a sequence of
# `{i32 type; u32 length; value}` records; tensors are a 32-byte header `{u64 size; i32 format;
# i32 dtype; u32 name_len; u32 dims_len; u32 dims_v2_len; u32 shape_range_len}` (lengths in bytes)
# followed by the name, dims, dims v2 and shape range. dtype and format use aclDataType / aclFormat.

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from geserve.backends.acl.description import GEAR_BATCH, GEAR_DIMS, GEAR_IMAGE_SIZE, OmTensor, format_name

INPUT_DESC, OUTPUT_DESC, DYNAMIC_BATCH, DYNAMIC_HW, DYNAMIC_DIMS, DYNAMIC_OUTPUT_SHAPE, DESIGNATE_SHAPE_ORDER = range(7)
_TENSOR_HEADER = struct.Struct("<QiiIIII")
_MAX_COUNT = 1 << 20  # no real model has this many tensors or gears; a larger count is corruption


class OmFormatError(ValueError):
    """The file is not what it claims to be, or is cut short; the message says where."""


@dataclass(slots=True)
class OmContents:
    """What one source in the file (records, graph or archive) says, before the gear input is set apart."""

    inputs: list[OmTensor] = field(default_factory=list)
    outputs: list[OmTensor] = field(default_factory=list)
    gear_kind: str = ""
    gear_shapes: list[tuple[int, ...]] = field(default_factory=list)
    data_name_order: list[str] = field(default_factory=list)
    soc_version: str | None = None
    # The NetOutput's `_dynamic_output_dims`; None where this source cannot say (OM2 metadata, no record).
    dynamic_output_dims: list[str] | None = None


class Cursor:
    """Bounds-checked little-endian reads; running off the end is an OmFormatError naming `what`."""

    def __init__(self, data: bytes, what: str) -> None:
        self.data = data
        self.offset = 0
        self.what = what

    @property
    def left(self) -> int:
        return len(self.data) - self.offset

    def take(self, count: int) -> bytes:
        if count < 0 or count > self.left:
            raise OmFormatError(
                f"{self.what} is truncated: {count} bytes wanted at offset {self.offset}, {self.left} left"
            )
        chunk = self.data[self.offset : self.offset + count]
        self.offset += count
        return chunk

    def unpack(self, layout: struct.Struct) -> tuple[int, ...]:
        values: tuple[int, ...] = layout.unpack(self.take(layout.size))
        return values

    def u32(self) -> int:
        return int.from_bytes(self.take(4), "little")

    def count(self, item_bytes: int) -> int:
        """A u32 element count that the bytes left can actually hold."""
        value = self.u32()
        if value > _MAX_COUNT or value * item_bytes > self.left:
            raise OmFormatError(f"{self.what} claims {value} entries, more than its {self.left} bytes can hold")
        return value

    def i64s(self, byte_length: int) -> tuple[int, ...]:
        if byte_length % 8:
            raise OmFormatError(f"{self.what} has an int64 list of {byte_length} bytes")
        raw = self.take(byte_length)
        return struct.unpack(f"<{byte_length // 8}q", raw)

    def text(self, byte_length: int) -> str:
        return self.take(byte_length).decode("utf-8", errors="replace")


def parse_inout_info(data: bytes) -> OmContents:
    contents = OmContents()
    cursor = Cursor(data, "MODEL_INOUT_INFO")
    while cursor.left:
        kind, length = cursor.unpack(struct.Struct("<iI"))
        value = Cursor(cursor.take(length), f"MODEL_INOUT_INFO record {kind}")
        if kind == INPUT_DESC:
            contents.inputs = _tensors(value)
        elif kind == OUTPUT_DESC:
            contents.outputs = _tensors(value)
        elif kind == DYNAMIC_BATCH:
            count = value.count(8)
            contents.gear_kind = GEAR_BATCH
            contents.gear_shapes = [(gear,) for gear in value.i64s(8 * count)]
        elif kind in (DYNAMIC_HW, DYNAMIC_DIMS):
            contents.gear_kind = GEAR_IMAGE_SIZE if kind == DYNAMIC_HW else GEAR_DIMS
            parts = [value.u32() for _ in range(value.count(4))]
            contents.gear_shapes = [value.i64s(8 * part) for part in parts]
        elif kind in (DESIGNATE_SHAPE_ORDER, DYNAMIC_OUTPUT_SHAPE):
            lengths = [value.u32() for _ in range(value.count(4))]
            strings = [value.text(length) for length in lengths]
            if kind == DESIGNATE_SHAPE_ORDER:
                contents.data_name_order = strings
            else:  # written from the NetOutput's `_dynamic_output_dims` (model_introduction.cc)
                contents.dynamic_output_dims = strings
        # Record types added later say nothing the description needs.
    return contents


def _tensors(cursor: Cursor) -> list[OmTensor]:
    tensors = []
    for index in range(cursor.count(_TENSOR_HEADER.size)):
        size, fmt, dtype, name_len, dims_len, dims_v2_len, range_len = cursor.unpack(_TENSOR_HEADER)
        name = cursor.text(name_len)
        dims = cursor.i64s(dims_len)
        dims_v2 = cursor.i64s(dims_v2_len)  # differs from dims only with static AIPP (resolve_input_dims)
        cursor.take(range_len)  # shape ranges: not served
        tensors.append(OmTensor(name, index, dtype, dims, size, format_name(fmt), dims_v2=dims_v2))
    return tensors
