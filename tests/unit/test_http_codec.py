"""The HTTP infer body codec: JSON and binary inputs, output encodings, raw requests."""

from __future__ import annotations

import json
import struct

import numpy as np
import orjson
import pytest

from geserve.core.raw import raw_input
from geserve.errors import InvalidArgumentError
from geserve.http import codec
from geserve.repository.config import parse_config_text
from geserve.types import InferResponse, OutputTensor, TensorSpec
from tests.unit.builders import model_version


def test_json_and_binary_inputs() -> None:
    header = {
        "id": "1",
        "parameters": {"binary_data_output": True},
        "inputs": [
            {"name": "a", "datatype": "INT32", "shape": [2, 2], "data": [[1, 2], [3, 4]]},
            {"name": "b", "datatype": "FP32", "shape": [2], "parameters": {"binary_data_size": 8}},
            {"name": "c", "datatype": "BYTES", "shape": [2], "data": ["x", "\u00e9"]},
            {"name": "d", "datatype": "BOOL", "shape": [1], "data": [True]},
        ],
        "outputs": [{"name": "o", "parameters": {"binary_data": False}}, {"name": "p"}],
    }
    blob = np.array([1.5, 2.5], dtype=np.float32).tobytes()
    request, encoding = codec.decode_request(header, memoryview(blob), "m", "")
    a, b, c, d = request.inputs
    assert isinstance(a.data, np.ndarray) and a.data.dtype == np.int32 and a.data.tolist() == [[1, 2], [3, 4]]
    assert isinstance(b.data, memoryview) and bytes(b.data) == blob
    assert isinstance(c.data, np.ndarray) and c.data.tolist() == [b"x", "\u00e9".encode()]
    assert isinstance(d.data, np.ndarray) and d.data.dtype == np.bool_
    assert request.id == "1"
    assert [o.name for o in request.outputs] == ["o", "p"]
    assert not encoding.is_binary("o") and encoding.is_binary("p") and encoding.is_binary("unlisted")


@pytest.mark.parametrize(
    ("header", "error", "message"),
    [
        (
            {"inputs": [{"name": "a", "datatype": "FP16", "shape": [1], "data": [1.0]}]},
            InvalidArgumentError,
            "receiving FP16 data via JSON",
        ),
        (
            {"inputs": [{"name": "a", "datatype": "BF16", "shape": [1], "data": [1.0]}]},
            InvalidArgumentError,
            "receiving BF16 data via JSON",
        ),
        (
            {"inputs": [{"name": "a", "datatype": "INT8", "shape": [1], "data": [300]}]},
            InvalidArgumentError,
            "out of range for INT8",
        ),
        (
            {"inputs": [{"name": "a", "datatype": "INT32", "shape": [1], "data": [1.5]}]},
            InvalidArgumentError,
            "expected INT32 values",
        ),
        (
            {"inputs": [{"name": "a", "datatype": "BOOL", "shape": [1], "data": [1]}]},
            InvalidArgumentError,
            "expected BOOL values",
        ),
        (
            {"inputs": [{"name": "a", "datatype": "BYTES", "shape": [1], "data": [1]}]},
            InvalidArgumentError,
            "BYTES elements must be strings",
        ),
        (
            {"inputs": [{"name": "a", "datatype": "INT32", "shape": [True], "data": [1]}]},
            InvalidArgumentError,
            "'shape' of input 'a'",
        ),
        (
            {
                "inputs": [
                    {"name": "a", "datatype": "INT32", "shape": [1], "data": [1], "parameters": {"binary_data_size": 4}}
                ]
            },
            InvalidArgumentError,
            "exactly one of",
        ),
        ({"inputs": [], "parameters": {"x": [1]}}, InvalidArgumentError, "parameter 'x' of the inference request"),
        ({"inputs": [], "outputs": "o"}, InvalidArgumentError, "'outputs' of the inference request must be an array"),
    ],
)
def test_bad_requests(header: dict[str, object], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        codec.decode_request(header, memoryview(b""), "m", "")


def test_leftover_binary_data_is_refused() -> None:
    with pytest.raises(
        InvalidArgumentError, match="holds 4 bytes of binary data but its inputs' 'binary_data_size' add up to 0"
    ):
        codec.decode_request({"inputs": []}, memoryview(b"1234"), "m", "")


def test_loads_accepts_nan_and_infinity() -> None:
    parsed = codec.loads(b'{"data": [NaN, Infinity, -Infinity, 1]}')
    assert np.isnan(parsed["data"][0]) and parsed["data"][1:] == [float("inf"), float("-inf"), 1]
    with pytest.raises(InvalidArgumentError, match="failed to parse the request JSON buffer"):
        codec.loads(b"{")


def test_encode_response_json_binary_and_special_floats() -> None:
    response = InferResponse(
        "m",
        "1",
        (
            OutputTensor("f", "FP32", np.array([[np.nan, np.inf, 1.0]], dtype=np.float32)),
            OutputTensor("s", "BYTES", np.array([b"ab", b""], dtype=object)),
            OutputTensor("h", "FP16", np.array([0.5], dtype=np.float16)),
            OutputTensor("i", "INT64", np.array([[1, 2]], dtype=np.int64)),
        ),
        id="",
    )
    encoding = codec.OutputEncoding(default_binary=False, per_output={"i": True, "s": True})
    header, blobs = codec.encode_response(response, encoding)
    decoded = json.loads(header)
    assert "id" not in decoded and "parameters" not in decoded
    f, s, h, i = decoded["outputs"]
    assert f["shape"] == [1, 3] and np.isnan(f["data"][0]) and f["data"][1:] == [float("inf"), 1.0]
    assert "parameters" not in f
    assert s["parameters"] == {"binary_data_size": 10} and "data" not in s
    assert h["data"] == [0.5]
    assert i["parameters"] == {"binary_data_size": 16}
    assert bytes(blobs[0]) == struct.pack("<I", 2) + b"ab" + struct.pack("<I", 0)
    assert np.frombuffer(bytes(blobs[1]), dtype=np.int64).tolist() == [1, 2]
    plain, _ = codec.encode_response(InferResponse("m", "1", (response.outputs[3],), id="x"), encoding)
    assert orjson.loads(plain)["id"] == "x"


RAW = """
name: "raw"
max_batch_size: 8
input [ { name: "IN" data_type: %s dims: [ %s ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""


def raw_inputs(dtype: str, dims: str) -> tuple[TensorSpec, ...]:
    return tuple(model_version(parse_config_text(RAW % (dtype, dims), "c")).inputs.values())


def test_raw_requests_deduce_the_shape() -> None:
    request = codec.raw_request(memoryview(bytes(24)), "raw", "2")
    assert request.inputs == () and request.raw_body is not None and request.model_version == "2"
    assert request.parameters == {"binary_data_output": True}
    tensor = raw_input(memoryview(bytes(24)), "raw", raw_inputs("TYPE_FP32", "2, -1"))
    assert tensor.name == "IN" and tensor.datatype == "FP32" and tensor.shape == (1, 2, 3)
    string = raw_input(memoryview(b"hello"), "raw", raw_inputs("TYPE_STRING", "1"))
    assert string.shape == (1, 1) and isinstance(string.data, np.ndarray) and string.data[0, 0] == b"hello"
    with pytest.raises(InvalidArgumentError, match="more than one variable-sized dimension"):
        raw_input(memoryview(bytes(24)), "raw", raw_inputs("TYPE_FP32", "-1, -1"))
    with pytest.raises(
        InvalidArgumentError, match="For BYTE datatype raw input 'IN', the model must have input shape \\[1\\]"
    ):
        raw_input(memoryview(b"x"), "raw", raw_inputs("TYPE_STRING", "2"))
    with pytest.raises(InvalidArgumentError, match="but got 2 inputs in 'raw' model configuration"):
        raw_input(memoryview(b"x"), "raw", raw_inputs("TYPE_STRING", "1") * 2)
