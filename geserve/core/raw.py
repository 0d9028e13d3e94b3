"""Triton's raw binary requests: a body that is one input's bytes, shaped from the config of the version found."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from geserve.errors import InvalidArgumentError
from geserve.residency import SharedTensor
from geserve.types import InferInput, InferRequest, TensorSpec


def raw_input(body: memoryview | SharedTensor, model_name: str, inputs: Sequence[TensorSpec]) -> InferInput:
    """The one input a raw request's `body` holds, its shape deduced from the config's `inputs`."""
    if len(inputs) != 1:
        raise InvalidArgumentError(
            f"Raw request must only have 1 input (found 1) to be deduced but got {len(inputs)} inputs "
            f"in '{model_name}' model configuration"
        )
    spec = inputs[0]
    batch = (1,) if spec.batched else ()
    itemsize = spec.dtype.itemsize
    if itemsize is None:
        if spec.dims not in ((1,), (-1,)):
            raise InvalidArgumentError(
                f"For BYTE datatype raw input '{spec.name}', the model must have input shape [1]"
            )
        shape = (*batch, 1)
        element = np.empty(1, dtype=np.object_)
        # The whole body is the one string element.
        element[0] = bytes(body.array.data) if isinstance(body, SharedTensor) else bytes(body)
        return InferInput(spec.name, spec.dtype.wire, shape, element.reshape(shape))
    variable = [i for i, d in enumerate(spec.dims) if d == -1]
    if len(variable) > 1:
        raise InvalidArgumentError(
            f"The shape of the raw input '{spec.name}' can not be deduced because there are more than one "
            "variable-sized dimension"
        )
    dims = list(spec.dims)
    if variable:
        fixed = math.prod(d for d in dims if d != -1) * itemsize
        dims[variable[0]] = body.nbytes // fixed if fixed else 0
    shape = batch + tuple(dims)
    if isinstance(body, SharedTensor):  # the bytes stay where they lie, seen as the input's type and shape
        return InferInput(spec.name, spec.dtype.wire, shape, SharedTensor(spec.dtype.wire, shape, body.where))
    return InferInput(spec.name, spec.dtype.wire, shape, body)


def decoded_raw(request: InferRequest, model_name: str, inputs: Sequence[TensorSpec]) -> InferRequest:
    """The request with a raw binary body (the `raw` extension) as its one input; the request itself otherwise."""
    if request.raw_body is None:
        return request
    return replace(request, inputs=(raw_input(request.raw_body, model_name, inputs),), raw_body=None)
