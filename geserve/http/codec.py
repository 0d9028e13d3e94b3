"""The v2 infer body: JSON header plus binary tensor data, in and out, and raw binary requests."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from geserve.codecs import bytes as bytes_codec
from geserve.codecs import dtypes
from geserve.errors import InvalidArgumentError
from geserve.types import (
    InferInput,
    InferRequest,
    InferResponse,
    OutputTensor,
    ParameterValue,
    RequestedOutput,
)

BINARY_DATA = "binary_data"
HEADER_LENGTH = "Inference-Header-Content-Length"


@dataclass(frozen=True, slots=True)
class OutputEncoding:
    """Which outputs a response carries as binary data, and which as JSON `data`."""

    default_binary: bool
    per_output: Mapping[str, bool] = field(default_factory=dict)

    def is_binary(self, name: str) -> bool:
        return self.per_output.get(name, self.default_binary)


ALL_BINARY = OutputEncoding(default_binary=True)


def loads(data: bytes | memoryview) -> Any:
    """Parse JSON; NaN and Infinity literals (sent by Triton clients) are accepted."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as error:
        try:  # orjson is strict JSON; the standard library also takes NaN / Infinity
            value = json.loads(bytes(data))
            # ...and lone surrogate escapes ("\ud800"), which no response could encode: orjson says so.
            orjson.dumps(value)
            return value
        except (ValueError, RecursionError, TypeError, orjson.JSONEncodeError):
            raise InvalidArgumentError(f"failed to parse the request JSON buffer: {error}") from None


def _parameters(value: Any, where: str) -> dict[str, ParameterValue]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidArgumentError(f"'parameters' of {where} must be a JSON object")
    for key, item in value.items():
        if not isinstance(item, bool | int | float | str):
            raise InvalidArgumentError(f"parameter '{key}' of {where} must be a bool, number or string")
    return value


def _shape(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in value):
        raise InvalidArgumentError(f"'shape' of input '{name}' must be an array of integers")
    if any(d < 0 for d in value):
        raise InvalidArgumentError(f"'shape' of input '{name}' must not hold negative dimensions, got {value}")
    return tuple(value)


def flatten(data: Any) -> list[Any]:
    """A JSON value's leaves in order: nested lists flattened, a scalar as a list of one."""
    if not isinstance(data, list):
        return [data]
    flat: list[Any] = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            flat.append(item)
        else:
            stack.pop()
    return flat


# JSON element kinds each datatype takes: as Triton's, numbers are not booleans and booleans not numbers.
_ACCEPTS = {"b": "b", "i": "iu", "u": "iu", "f": "iuf"}


def _json_tensor(data: Any, datatype: dtypes.DataType, shape: tuple[int, ...], name: str) -> np.ndarray:
    """A JSON `data` field as an array of the declared datatype and shape."""
    if datatype.wire in ("FP16", "BF16"):
        raise InvalidArgumentError(
            f"receiving {datatype.wire} data via JSON is not supported. "
            f"Please use the binary data format for input '{name}'"
        )
    count = math.prod(shape)
    if datatype.wire == "BYTES":
        flat = flatten(data)
        if not all(isinstance(item, str) for item in flat):
            raise InvalidArgumentError(f"unable to parse 'data' of input '{name}': BYTES elements must be strings")
        array = np.empty(len(flat), dtype=np.object_)
        array[:] = [item.encode("utf-8") for item in flat]
    else:
        try:
            parsed = np.asarray(data)
        except ValueError as error:
            raise InvalidArgumentError(f"unable to parse 'data' of input '{name}': {error}") from None
        if parsed.dtype.kind in "iuf" and any(isinstance(item, bool) for item in flatten(data)):
            parsed = parsed.astype(np.bool_)  # numpy read [1, true] as integers: refused below as booleans
        if parsed.size and parsed.dtype.kind not in _ACCEPTS[datatype.numpy.kind]:
            raise InvalidArgumentError(
                f"unable to parse 'data' of input '{name}': expected {datatype.wire} values, got {parsed.dtype.kind!r} "
                "elements"
            )
        if parsed.size and not dtypes.fits(datatype, parsed.min(), parsed.max()):
            raise InvalidArgumentError(
                f"unable to parse 'data' of input '{name}': value out of range for {datatype.wire}"
            )
        array = parsed.astype(datatype.numpy, copy=False).reshape(-1)
    if array.size != count:
        raise InvalidArgumentError(
            f"unable to parse 'data' of input '{name}': Shape does not match true shape of 'data' field "
            f"({array.size} elements for shape {list(shape)})"
        )
    return array.reshape(shape)


def decode_request(
    header: Any, binary: memoryview, model_name: str, model_version: str
) -> tuple[InferRequest, OutputEncoding]:
    """The JSON header (already parsed) and the binary section -> InferRequest, and which outputs go binary."""
    if not isinstance(header, dict):
        raise InvalidArgumentError("the inference request JSON must be an object")
    request_id = header.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidArgumentError("'id' of the inference request must be a string")
    parameters = _parameters(header.get("parameters"), "the inference request")
    raw_inputs = header.get("inputs")
    if not isinstance(raw_inputs, list):
        raise InvalidArgumentError("the inference request must hold an 'inputs' array")
    inputs = []
    offset = 0
    for item in raw_inputs:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise InvalidArgumentError("each input must be a JSON object with a string 'name'")
        name = item["name"]
        if not isinstance(item.get("datatype"), str):
            raise InvalidArgumentError(f"input '{name}' must have a string 'datatype'")
        datatype = dtypes.from_wire(item["datatype"])
        shape = _shape(item.get("shape"), name)
        input_parameters = _parameters(item.get("parameters"), f"input '{name}'")
        binary_size = input_parameters.get("binary_data_size")
        sources = ("data" in item) + (binary_size is not None) + ("shared_memory_region" in input_parameters)
        if sources != 1:
            raise InvalidArgumentError(
                f"input '{name}' must have exactly one of 'data', 'binary_data_size' or 'shared_memory_region'"
            )
        data: np.ndarray | memoryview = memoryview(b"")  # shared memory: refused by validation
        if binary_size is not None:
            if not isinstance(binary_size, int) or isinstance(binary_size, bool) or binary_size < 0:
                raise InvalidArgumentError(f"'binary_data_size' of input '{name}' must be a non-negative integer")
            if offset + binary_size > len(binary):
                raise InvalidArgumentError(
                    f"unexpected end of binary data for input '{name}': it needs {binary_size} bytes at offset "
                    f"{offset}, but the request has {len(binary)} bytes of binary data"
                )
            data = binary[offset : offset + binary_size]
            offset += binary_size
        elif "data" in item:
            data = _json_tensor(item["data"], datatype, shape, name)
        inputs.append(InferInput(name, datatype.wire, shape, data, input_parameters))
    if offset != len(binary):
        raise InvalidArgumentError(
            f"the request holds {len(binary)} bytes of binary data but its inputs' 'binary_data_size' "
            f"add up to {offset}"
        )
    default_binary = parameters.get("binary_data_output", False) is True
    outputs, per_output = _requested_outputs(header.get("outputs"), default_binary)
    request = InferRequest(model_name, model_version, tuple(inputs), outputs, request_id, parameters)
    return request, OutputEncoding(default_binary, per_output)


def _requested_outputs(value: Any, default_binary: bool) -> tuple[tuple[RequestedOutput, ...], dict[str, bool]]:
    if value is None:
        return (), {}
    if not isinstance(value, list):
        raise InvalidArgumentError("'outputs' of the inference request must be an array")
    outputs = []
    binary: dict[str, bool] = {}
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise InvalidArgumentError("each requested output must be a JSON object with a string 'name'")
        name = item["name"]
        parameters = _parameters(item.get("parameters"), f"output '{name}'")
        binary[name] = bool(parameters.get(BINARY_DATA, default_binary))
        outputs.append(RequestedOutput(name, parameters))
    return tuple(outputs), binary


def raw_request(body: memoryview, model_name: str, model_version: str) -> InferRequest:
    """A body that is one input's raw bytes (header length 0): shaped once the model's config is at hand."""
    return InferRequest(model_name, model_version, (), (), "", {"binary_data_output": True}, raw_body=body)


def _json_data(tensor: OutputTensor) -> tuple[Any, bool]:
    """An output's `data` list, and whether it holds NaN or Infinity (which strict JSON cannot)."""
    array = tensor.data
    if tensor.datatype == "BYTES":
        return [item.decode("utf-8", errors="replace") for item in array.reshape(-1)], False
    if tensor.datatype == "BF16":
        array = (array.astype(np.uint32) << 16).view(np.float32)
    elif tensor.datatype == "FP16":
        array = array.astype(np.float32)
    flat = np.ascontiguousarray(array.reshape(-1))
    special = array.dtype.kind == "f" and not bool(np.isfinite(flat).all())
    return flat, special


def encode_response(response: InferResponse, encoding: OutputEncoding) -> tuple[bytes, list[bytes | memoryview]]:
    """The response JSON header and the binary blobs that follow it, in output order."""
    outputs = []
    blobs: list[bytes | memoryview] = []
    special = False
    for tensor in response.outputs:
        entry: dict[str, Any] = {
            "name": tensor.name,
            "datatype": tensor.datatype,
            "shape": list(tensor.shape),
        }
        if tensor.in_shared_memory:
            outputs.append(entry)  # the data is in the client's region: described only, as Triton answers
            continue
        if encoding.is_binary(tensor.name):
            blob = bytes_codec.wire_bytes(tensor.datatype, tensor.data)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"], has_special = _json_data(tensor)
            special = special or has_special
        outputs.append(entry)
    header: dict[str, Any] = {}
    if response.id:
        header["id"] = response.id
    header["model_name"] = response.model_name
    header["model_version"] = response.model_version
    if response.parameters:
        header["parameters"] = dict(response.parameters)
    header["outputs"] = outputs
    if special:
        return json.dumps(header, default=lambda a: a.tolist(), separators=(",", ":")).encode(), blobs
    return orjson.dumps(header, option=orjson.OPT_SERIALIZE_NUMPY), blobs
