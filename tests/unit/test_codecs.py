"""The dtype table and BYTES framing."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor, triton_to_np_dtype

from geserve._generated import model_config_pb2 as mc
from geserve.codecs import bytes as bytes_codec
from geserve.codecs import dtypes
from geserve.errors import InvalidArgumentError

WIRE_NAMES = [
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
    "BYTES",
    "BF16",
]


@pytest.mark.parametrize("wire", WIRE_NAMES)
def test_table_round_trips(wire: str) -> None:
    datatype = dtypes.from_wire(wire)
    assert dtypes.from_config(datatype.config) is datatype
    assert datatype.config_name == ("TYPE_STRING" if wire == "BYTES" else f"TYPE_{wire}")
    assert dtypes.from_onnx(f"tensor({datatype.onnx})") is datatype
    if wire not in ("BF16",):
        assert dtypes.from_numpy(datatype.numpy) is datatype
        # tritonclient agrees on the numpy type of every wire name it knows.
        assert np.dtype(triton_to_np_dtype(wire)) == datatype.numpy


def test_itemsize_and_lookups() -> None:
    assert dtypes.from_wire("FP32").itemsize == 4
    assert dtypes.from_wire("BYTES").itemsize is None
    assert dtypes.from_numpy(np.dtype("S5")).wire == "BYTES"
    assert dtypes.from_numpy(np.dtype(">i4")).wire == "INT32"
    assert dtypes.from_onnx("tensor(complex64)") is None
    with pytest.raises(InvalidArgumentError, match="invalid datatype 'FP8'"):
        dtypes.from_wire("FP8")
    with pytest.raises(InvalidArgumentError):
        dtypes.from_config(mc.TYPE_INVALID)


def test_bytes_framing_matches_tritonclient() -> None:
    array = np.array([[b"", b"a", "\u00e9".encode()], [b"\x00\xff", b"long" * 100, b"z"]], dtype=object)
    framed = bytes_codec.serialize(array)
    assert framed == serialize_byte_tensor(array).item()
    decoded = bytes_codec.deserialize(framed)
    assert list(decoded) == list(array.reshape(-1))
    assert list(deserialize_bytes_tensor(framed)) == list(decoded)
    assert bytes_codec.serialize(np.array(["h\u00e9"], dtype=object)) == struct.pack("<I", 3) + "h\u00e9".encode()


@pytest.mark.parametrize("blob", [b"\x01\x00", struct.pack("<I", 5) + b"abc", struct.pack("<I", 2**32 - 1)])
def test_truncated_framing_is_a_client_error(blob: bytes) -> None:
    with pytest.raises(InvalidArgumentError, match="BYTES tensor data is truncated"):
        bytes_codec.deserialize(blob)


def test_deserialize_stops_past_the_expected_count() -> None:
    framed = bytes_codec.serialize(np.array([b"a"] * 1000, dtype=object))
    assert len(bytes_codec.deserialize(framed, element_count=3)) == 4


def test_to_bytes_array() -> None:
    converted = bytes_codec.to_bytes_array(np.array([["a", "b"]], dtype=object))
    assert converted.shape == (1, 2) and converted[0, 1] == b"b"
