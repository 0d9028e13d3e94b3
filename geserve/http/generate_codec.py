"""The generate extension's JSON as Triton maps it: request keys to inputs or parameters, a response to one object."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import orjson

from geserve.codecs import dtypes
from geserve.errors import GeserveError, InternalError, InvalidArgumentError
from geserve.http.codec import flatten
from geserve.types import InferInput, InferRequest, InferResponse, ModelMetadata, OutputTensor, ParameterValue

# The one key Triton's generate schema reserves: an object whose members map as the top level's do.
PARAMETERS_KEY = "parameters"
_INT64 = (-(1 << 63), (1 << 63) - 1)
# TritonJson's texts for a JSON value of the wrong kind; Triton answers them with 500 (they are its
# INTERNAL errors), and geserve answers as Triton does.
_NOT_BOOL = "attempt to access JSON non-boolean as boolean"
_NOT_UINT = "attempt to access JSON non-unsigned-integer as unsigned-integer"
_NOT_INT = "attempt to access JSON non-signed-integer as signed-integer"
_NOT_NUMBER = "attempt to access JSON non-number as double"
_NOT_STRING = "attempt to access JSON non-string as string"
_SHAPE_MISMATCH = "Unable to parse 'data': Shape does not match true shape of 'data' field"


class JsonObject(list[tuple[str, Any]]):
    """A JSON object as its members in order, repeated keys kept: Triton's parser keeps them, and a repeated
    input is an error there, not a silent last-one-wins."""


def parse(body: bytes | memoryview) -> Any:
    """The request body as JSON, objects as JsonObject; NaN and Infinity literals are accepted."""
    try:
        return json.loads(bytes(body), object_pairs_hook=JsonObject)
    except (ValueError, RecursionError) as error:
        raise InvalidArgumentError(f"failed to parse the request JSON buffer: {error}") from None


def decode_request(document: Any, metadata: ModelMetadata, model_version: str) -> InferRequest:
    """A parsed generate request -> InferRequest: keys naming an input of the model become that input,
    shaped from the model's dims; the others (and the members of `parameters`) become request parameters."""
    if not isinstance(document, JsonObject):
        raise InternalError("attempt to get members for non-object")
    request_id = ""
    for key, value in document:  # the first "id", as Triton finds it; it is also a parameter there
        if key == "id":
            if not isinstance(value, str):
                raise InternalError(f"Unable to parse 'id': {_NOT_STRING}")
            request_id = _text(value)
            break
    builder = _RequestBuilder({spec.name: (spec.datatype, spec.shape) for spec in metadata.inputs})
    builder.members(document, top=True)
    return InferRequest(
        metadata.name, model_version, tuple(builder.inputs.values()), (), request_id, builder.parameters
    )


class _RequestBuilder:
    """Collects the inputs and parameters of one generate request, member by member."""

    def __init__(self, specs: dict[str, tuple[str, tuple[int, ...]]]) -> None:
        self._specs = specs
        self.inputs: dict[str, InferInput] = {}
        self.parameters: dict[str, ParameterValue] = {}

    def members(self, document: JsonObject, top: bool) -> None:
        for key, value in document:
            if top and key == PARAMETERS_KEY:
                self._nested(value)
            elif key in self._specs:
                self._input(key, value)
            elif key not in self.parameters:  # a repeated parameter keeps its first value, as Triton's lookup
                self.parameters[key] = _parameter(key, value)

    def _nested(self, value: Any) -> None:
        if PARAMETERS_KEY in self._specs:
            raise InvalidArgumentError(f"Keyword '{PARAMETERS_KEY}' for nested schema also given as input tensor name")
        if not isinstance(value, JsonObject):
            raise InternalError(
                f"Expected JSON object for keyword: '{PARAMETERS_KEY}': attempt to access JSON non-object as object"
            )
        try:
            self.members(value, top=False)
        except GeserveError as error:
            raise type(error)(f"Converting keyword: '{PARAMETERS_KEY}': {error.message}") from None

    def _input(self, name: str, value: Any) -> None:
        if name in self.inputs:
            raise InvalidArgumentError(f"input '{name}' already exists in request")
        wire, dims = self._specs[name]
        datatype = dtypes.from_wire(wire)
        items = value if isinstance(value, list) else [value]
        if datatype.wire == "BYTES" and not all(isinstance(item, str) for item in flatten(items)):
            raise InternalError(f"Unable to parse JSON bytes array: {_NOT_STRING}")
        shape = _shape(dims, len(items), name)
        self.inputs[name] = InferInput(name, datatype.wire, shape, _array(items, datatype, name).reshape(shape))


def _parameter(key: str, value: Any) -> ParameterValue:
    """A member that names no input, as a request parameter: a string, integer, boolean or number."""
    if isinstance(value, str):
        return _text(value)
    if isinstance(value, bool | float):
        return value
    if isinstance(value, int):
        # Triton reads integers beyond int64 as doubles.
        return value if _INT64[0] <= value <= _INT64[1] else float(value)
    raise InvalidArgumentError(f"parameter '{key}' has invalid type. It should be either 'int', 'bool', or 'string'.")


def _text(value: str) -> str:
    """A JSON string that UTF-8 can carry: a lone surrogate escape ("\\ud800") cannot."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidArgumentError(f"failed to parse the request JSON buffer: {error}") from None
    return value


def _shape(dims: tuple[int, ...], count: int, name: str) -> tuple[int, ...]:
    """Triton's two passes: the fixed dims divide the element count, the innermost variable dim takes what
    remains and the other variable dims are 1."""
    refused = InvalidArgumentError(f"The schema can not convert input '{name}' to tensor with proper shape")
    remaining = count
    for dim in reversed(dims):
        if dim != -1:
            if (remaining % dim) if dim else remaining:
                raise refused
            remaining = remaining // dim if dim else 0
    shape = list(dims)
    for index in reversed(range(len(shape))):
        if shape[index] == -1:
            shape[index], remaining = remaining, 1
    if remaining != 1 and not (remaining == 0 and 0 in dims):
        raise refused
    return tuple(shape)


def _array(items: list[Any], datatype: dtypes.DataType, name: str) -> np.ndarray:
    """The values of one input as a flat array, each checked as Triton reads it; integers that do not fit
    the datatype are refused (Triton would wrap them around)."""
    if datatype.wire in ("FP16", "BF16"):
        raise InvalidArgumentError(
            f"receiving {datatype.wire} data via JSON is not supported. Please use the binary data format for "
            f"input {name}"
        )
    flat = flatten(items)
    if len(flat) != len(items):  # nested arrays count as one element each in Triton's reading
        raise InternalError(_SHAPE_MISMATCH)
    if datatype.wire == "BYTES":
        array = np.empty(len(flat), dtype=np.object_)
        array[:] = [_text(item).encode("utf-8") for item in flat]
        return array
    kind = datatype.numpy.kind
    for item in flat:
        number = isinstance(item, int) and not isinstance(item, bool)
        if kind == "b" and not isinstance(item, bool):
            raise InternalError(f"Unable to parse 'data': {_NOT_BOOL}")
        if kind == "u" and not (number and 0 <= item < 1 << 64):
            raise InternalError(f"Unable to parse 'data': {_NOT_UINT}")
        if kind == "i" and not (number and _INT64[0] <= item <= _INT64[1]):
            raise InternalError(f"Unable to parse 'data': {_NOT_INT}")
        if kind == "f" and not (number or isinstance(item, float)):
            raise InternalError(f"Unable to parse 'data': {_NOT_NUMBER}")
    if flat and kind in "iu" and not dtypes.fits(datatype, min(flat), max(flat)):
        raise InvalidArgumentError(
            f"Unable to parse 'data': a value of input '{name}' is out of range for {datatype.wire}"
        )
    return np.array(flat, dtype=datatype.numpy)


def encode_response(response: InferResponse) -> bytes:
    """One response as Triton's generate object: id (when set), model name and version, each response
    parameter and each output by name, keys sorted; where names collide the first of those wins, as in
    Triton. An output of one element is that element, any other a flat array."""
    fields: dict[str, Any] = {}
    if response.id:
        fields["id"] = response.id
    fields["model_name"] = response.model_name
    fields["model_version"] = response.model_version
    for key, value in response.parameters.items():
        fields.setdefault(key, value)
    special = False
    for tensor in response.outputs:
        if tensor.name not in fields:
            fields[tensor.name], has_special = _output_value(tensor)
            special = special or has_special
    if special:  # NaN and Infinity as the literals Triton's clients read, which strict JSON (orjson) has not
        return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return orjson.dumps(fields, option=orjson.OPT_SORT_KEYS)


def _output_value(tensor: OutputTensor) -> tuple[Any, bool]:
    """An output's JSON value, and whether it holds NaN or Infinity."""
    if tensor.datatype in ("FP16", "BF16"):
        raise InvalidArgumentError(
            f"sending {tensor.datatype} data via JSON is not supported. Please use the binary data format for output"
        )
    flat = tensor.data.reshape(-1)
    if tensor.datatype == "BYTES":
        values: list[Any] = [bytes(item).decode("utf-8", errors="replace") for item in flat]
        special = False
    else:
        values = flat.tolist()
        special = flat.dtype.kind == "f" and not all(math.isfinite(value) for value in values)
    return (values[0] if len(values) == 1 else values), special
