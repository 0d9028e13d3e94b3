"""Request checks against a model's config, with Triton's error texts."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

import numpy as np

from geserve.codecs import bytes as bytes_codec
from geserve.core.classification import classification_count
from geserve.errors import InternalError, InvalidArgumentError, UnsupportedError
from geserve.residency import Kind, SharedTensor
from geserve.snapshots import ServedVersion
from geserve.types import InferInput, InferRequest, Parameters, TensorSpec


class SharedRegions(Protocol):
    """Client shared memory as validation reads it (core.shared_memory): each call takes a tensor's parameters, what
    it is for messages, and a check of the byte size it names, called once the region and the bounds are checked and
    before any read."""

    def read(self, parameters: Parameters, what: str, check: Callable[[int], None] | None = None) -> memoryview:
        """The input's bytes, copied out of the region."""
        ...

    def locate(self, parameters: Parameters, what: str, check: Callable[[int], None] | None = None) -> SharedTensor:
        """Where the input's bytes lie in the region, for a worker to read them there."""
        ...


# (datatype, shape, raw little-endian bytes / framed BYTES elements / an array) -> the tensor in shared memory.
Placer = Callable[[str, tuple[int, ...], memoryview | np.ndarray], SharedTensor]


def check_parameters(parameters: Parameters) -> None:
    """Reject reserved `triton_` keys and badly typed scheduling parameters."""
    for key, value in parameters.items():
        if key.startswith("triton_"):
            raise InvalidArgumentError(
                "parameter keys starting with 'triton_' are reserved for Triton usage and should not be specified."
            )
        if key in ("priority", "timeout") and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise InvalidArgumentError(f"parameter '{key}' must be a non-negative integer, got {value!r}")
        if key in ("sequence_start", "sequence_end", "binary_data_output") and not isinstance(value, bool):
            raise InvalidArgumentError(f"parameter '{key}' must be a boolean, got {value!r}")
        if key == "sequence_id" and (isinstance(value, bool) or not isinstance(value, int | str)):
            raise InvalidArgumentError(
                f"parameter 'sequence_id' must be an unsigned integer or a string, got {value!r}"
            )


def _dims_text(dims: tuple[int, ...]) -> str:
    return "[" + ",".join(str(d) for d in dims) + "]"


def _dims_match(shape: tuple[int, ...], dims: tuple[int, ...]) -> bool:
    return len(shape) == len(dims) and all(d == -1 or d == s for s, d in zip(shape, dims, strict=True))


def validate_inputs(
    request: InferRequest,
    model: ServedVersion,
    regions: SharedRegions | None = None,
    max_bytes_elements: int | None = None,
    *,
    place: Placer | None = None,
) -> dict[str, SharedTensor]:
    """Check every input against the config and return them as tensors: in the configured shape, or, with `place`,
    as the client shaped them and placed in shared memory by it (whoever runs the request reshapes them, see
    `reshaped`); an input in a client's region (`regions`) then stays there for the worker to read. A BYTES input
    may have `max_bytes_elements`."""
    name = model.name
    arrays: dict[str, SharedTensor] = {}
    batch_size: int | None = None
    for given in request.inputs:
        tensor = given
        spec = model.inputs.get(tensor.name)
        if spec is None:
            raise InvalidArgumentError(f"unexpected inference input '{tensor.name}' for model '{name}'")
        if tensor.name in arrays:
            raise InvalidArgumentError(f"input '{tensor.name}' already exists in request")
        if tensor.datatype != spec.dtype.wire:
            raise InvalidArgumentError(
                f"inference input '{tensor.name}' data-type is '{tensor.datatype}', "
                f"but model '{name}' expects '{spec.dtype.wire}'"
            )
        shape = tensor.shape
        item_shape = shape
        if spec.batched:
            if shape and shape[0] > model.max_batch_size:
                raise InvalidArgumentError(
                    f"inference request batch-size must be <= {model.max_batch_size} for '{name}'"
                )
            if shape and batch_size is not None and shape[0] != batch_size:
                raise InvalidArgumentError(f"input '{tensor.name}' batch size does not match other inputs for '{name}'")
            if shape:
                batch_size = shape[0]
            item_shape = shape[1:]
        if (not shape and spec.batched) or any(d < 0 for d in shape) or not _dims_match(item_shape, spec.dims):
            raise InvalidArgumentError(
                f"unexpected shape for input '{tensor.name}' for model '{name}'. "
                f"Expected {_dims_text(spec.wire_shape)}, got {_dims_text(shape)}"
            )
        if max_bytes_elements is not None and spec.dtype.itemsize is None:
            _check_element_count(tensor, max_bytes_elements, name)
        if "shared_memory_region" in tensor.parameters:
            # Read only once the input is known to be what the model takes, and never more than the tensor: a
            # region's byte size is the client's to choose (a sparse GiB costs it nothing, a read of it costs us).
            if regions is None:
                raise UnsupportedError(f"input '{tensor.name}': shared memory is not supported by this server")
            check_size = functools.partial(_check_shared_size, tensor, spec, name)
            what = f"input '{tensor.name}'"
            found: memoryview | SharedTensor
            if place is not None and spec.dtype.itemsize is not None:
                # A worker reads the region itself; its byte size is checked already.
                located = regions.locate(tensor.parameters, what, check_size)
                found = SharedTensor(spec.dtype.wire, tensor.shape, located.where)
            else:  # BYTES elements are counted here, so they are read here
                found = regions.read(tensor.parameters, what, check_size)
            tensor = replace(tensor, data=found)
        checked = _as_tensor(tensor, spec, name, place)
        if place is None:
            checked = reshaped(checked, spec)
        arrays[tensor.name] = checked
    if len(arrays) != len(model.inputs):
        missing = [n for n, s in model.inputs.items() if n not in arrays and not s.optional]
        if missing:
            required = sum(1 for s in model.inputs.values() if not s.optional)
            raise InvalidArgumentError(
                f"expected {required} inputs but got {len(arrays)} inputs for model '{name}'. "
                f"Got input(s) {list(arrays)}, but missing required input(s) {missing}. "
                "Please provide all required input(s)."
            )
    return arrays


def _check_element_count(tensor: InferInput, limit: int, model_name: str) -> None:
    """Each BYTES element becomes a Python object: their count, not the bytes they fill, is what they cost."""
    count = math.prod(tensor.shape)
    if count > limit:
        raise InvalidArgumentError(
            f"inference input '{tensor.name}' for model '{model_name}' has {count} BYTES elements, more than the "
            f"{limit} allowed; see --max-bytes-tensor-elements"
        )


def decode_cost(request: InferRequest) -> int:
    """The bytes validation reads or splits one by one (BYTES elements, client shared memory): past a size, work
    for a thread, not for the event loop."""
    cost = 0
    for tensor in request.inputs:
        size = tensor.parameters.get("shared_memory_byte_size")
        if isinstance(size, int) and not isinstance(size, bool) and "shared_memory_region" in tensor.parameters:
            cost += size
        elif tensor.datatype == "BYTES" and not isinstance(tensor.data, np.ndarray):
            cost += tensor.data.nbytes
    return cost


def _check_shared_size(tensor: InferInput, spec: TensorSpec, model_name: str, size: int) -> None:
    """A fixed-size input in shared memory names exactly its byte size (Triton checks the same), before any read."""
    if spec.dtype.itemsize is None:
        return  # BYTES elements have no fixed size: the elements read are counted instead
    expected = math.prod(tensor.shape) * spec.dtype.itemsize
    if size != expected:
        raise InvalidArgumentError(
            f"input byte size mismatch for input '{tensor.name}' for model '{model_name}'. "
            f"Expected {expected}, got {size}"
        )


def reshaped(tensor: SharedTensor, spec: TensorSpec) -> SharedTensor:
    """An input as the model takes it: in the config's `reshape`, when it has one (its batch dimension kept)."""
    if spec.reshape is None:
        return tensor
    return tensor.reshaped(((tensor.shape[0],) if spec.batched else ()) + spec.reshape)


def _as_tensor(tensor: InferInput, spec: TensorSpec, model_name: str, place: Placer | None) -> SharedTensor:
    """The input as a tensor of the declared shape, its byte size (or BYTES element count) checked first; bytes in
    shared memory stay there; raw bytes are viewed as an array without copying, or handed to `place`."""
    data = tensor.data
    if isinstance(data, np.ndarray):  # front-ends build typed arrays with the declared shape
        if place is not None:
            return place(spec.dtype.wire, tensor.shape, data)
        return SharedTensor.local(data, spec.dtype.wire)
    count = math.prod(tensor.shape)
    itemsize = spec.dtype.itemsize
    if isinstance(data, SharedTensor):
        if itemsize is None and data.where is not None and data.where.kind == Kind.CLIENT:
            raise InternalError("a BYTES input in client shared memory must be read to be checked")
        if itemsize is None:
            _check_string_count(tensor, data.array, count, model_name)  # the elements are split to be counted
        elif data.nbytes != count * itemsize:
            raise _byte_size_mismatch(tensor, model_name, count * itemsize, data.nbytes)
        return data.reshaped(tensor.shape) if data.shape != tensor.shape else data
    if itemsize is None:
        strings = bytes_codec.deserialize(data, count)
        _check_string_count(tensor, strings, count, model_name)
        if place is not None:
            return place("BYTES", tensor.shape, data)  # the framed elements as they came
        return SharedTensor.local(strings.reshape(tensor.shape), "BYTES")
    expected = count * itemsize
    if data.nbytes != expected:
        raise _byte_size_mismatch(tensor, model_name, expected, data.nbytes)
    if place is not None:
        return place(spec.dtype.wire, tensor.shape, data)
    array = np.frombuffer(data, dtype=spec.dtype.numpy.newbyteorder("<")).reshape(tensor.shape)
    return SharedTensor.local(array, spec.dtype.wire)


def _check_string_count(tensor: InferInput, strings: np.ndarray, count: int, model_name: str) -> None:
    if strings.size != count:
        raise InvalidArgumentError(
            f"expected {count} string elements for inference input '{tensor.name}' for model "
            f"'{model_name}', got {strings.size}"
        )


def _byte_size_mismatch(tensor: InferInput, model_name: str, expected: int, given: int) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"input byte size mismatch for input '{tensor.name}' for model '{model_name}'. Expected {expected}, got {given}"
    )


def requested_output_names(request: InferRequest, model: ServedVersion) -> tuple[str, ...]:
    """The outputs to compute: those requested, in order, or all of them."""
    if not request.outputs:
        return model.output_names
    names: list[str] = []
    for output in request.outputs:
        if "classification" in output.parameters:
            classification_count(output.parameters["classification"], output.name)
            if "shared_memory_region" in output.parameters:
                raise InvalidArgumentError(f"output '{output.name}': classification can not be used with shared memory")
        if output.name not in model.outputs:
            raise InvalidArgumentError(f"unexpected inference output '{output.name}' for model '{model.name}'")
        if output.name in names:
            raise InvalidArgumentError(f"output '{output.name}' already exists in request")
        names.append(output.name)
    return tuple(names)
