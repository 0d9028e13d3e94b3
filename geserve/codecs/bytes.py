"""Tensor bytes on the wire: length-framed BYTES elements, little-endian row-major bytes otherwise."""

from __future__ import annotations

import struct

import numpy as np

from geserve.errors import InvalidArgumentError

_LENGTH = struct.Struct("<I")


def deserialize(buffer: bytes | memoryview, element_count: int | None = None) -> np.ndarray:
    """Split a framed buffer into a 1-D object array of bytes; malformed framing is a client error."""
    view = memoryview(buffer).cast("B")
    end = len(view)
    items: list[bytes] = []
    offset = 0
    while offset < end:
        if offset + 4 > end:
            raise InvalidArgumentError("BYTES tensor data is truncated: incomplete element length")
        (length,) = _LENGTH.unpack_from(view, offset)
        offset += 4
        if offset + length > end:
            raise InvalidArgumentError(
                f"BYTES tensor data is truncated: element of {length} bytes at offset {offset - 4} "
                f"exceeds the {end} bytes given"
            )
        items.append(bytes(view[offset : offset + length]))
        offset += length
        if element_count is not None and len(items) > element_count:
            break
    array = np.empty(len(items), dtype=np.object_)
    array[:] = items
    return array


def serialize(array: np.ndarray) -> bytes:
    """Frame an array of bytes or str elements (row-major) into one buffer."""
    parts: list[bytes] = []
    for item in array.ravel(order="C"):
        data = item.encode("utf-8") if isinstance(item, str) else bytes(item)
        parts.append(_LENGTH.pack(len(data)))
        parts.append(data)
    return b"".join(parts)


def wire_bytes(datatype: str, array: np.ndarray) -> bytes | memoryview:
    """A tensor as the protocols carry it: framed elements for BYTES, else little-endian row-major bytes
    (a view of the array when it already is that)."""
    if datatype == "BYTES":
        return serialize(array)
    array = np.ascontiguousarray(array)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    return array.data.cast("B")


def to_bytes_array(array: np.ndarray) -> np.ndarray:
    """The same tensor as an object array whose elements are bytes (str elements UTF-8 encoded)."""
    out = np.empty(array.shape, dtype=np.object_)
    flat_out = out.reshape(-1)
    for index, item in enumerate(array.reshape(-1)):
        flat_out[index] = item.encode("utf-8") if isinstance(item, str) else bytes(item)
    return out
