"""Protobuf <-> core types for ModelInfer, metadata and parameters."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from geserve._generated import grpc_service_pb2 as pb
from geserve.codecs import bytes as bytes_codec
from geserve.codecs import dtypes
from geserve.errors import InvalidArgumentError
from geserve.grpc.raw import InferReply
from geserve.types import (
    InferInput,
    InferRequest,
    InferResponse,
    ModelMetadata,
    ParameterValue,
    RequestedOutput,
)

# Which InferTensorContents field carries each datatype (FP16 and BF16 have none: raw only).
_CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


# Stream options Triton's gRPC front-end consumes itself; they never reach the model.
EMPTY_FINAL_RESPONSE = "triton_enable_empty_final_response"
FINAL_RESPONSE = "triton_final_response"
_GRPC_OPTIONS = frozenset({EMPTY_FINAL_RESPONSE})


def parameters_from_proto(parameters: Mapping[str, pb.InferParameter]) -> dict[str, ParameterValue]:
    values: dict[str, ParameterValue] = {}
    for key, parameter in parameters.items():
        if key in _GRPC_OPTIONS:
            continue
        choice = parameter.WhichOneof("parameter_choice")
        if choice is not None:
            values[key] = getattr(parameter, choice)
    return values


def wants_final_flag(message: pb.ModelInferRequest) -> bool:
    """Whether a streaming client asked for `triton_final_response` on its responses."""
    option = message.parameters.get(EMPTY_FINAL_RESPONSE)
    return option is not None and option.WhichOneof("parameter_choice") == "bool_param" and option.bool_param


def _set_parameter(target: pb.InferParameter, value: ParameterValue) -> None:
    if isinstance(value, bool):
        target.bool_param = value
    elif isinstance(value, int):
        target.int64_param = value
    elif isinstance(value, float):
        target.double_param = value
    else:
        target.string_param = value


def _typed_contents(tensor: pb.ModelInferRequest.InferInputTensor, datatype: dtypes.DataType) -> np.ndarray:
    field = _CONTENTS_FIELD.get(datatype.wire)
    if field is None:
        raise InvalidArgumentError(
            f"input '{tensor.name}': {datatype.wire} data can only be sent in raw_input_contents"
        )
    values = getattr(tensor.contents, field)
    count = math.prod(tensor.shape)
    if len(values) != count:
        raise InvalidArgumentError(
            f"unexpected number of elements {len(values)} in '{field}' of input '{tensor.name}': "
            f"shape {list(tensor.shape)} needs {count}"
        )
    if datatype.wire == "BYTES":
        array = np.empty(count, dtype=np.object_)
        array[:] = list(values)
    else:
        # int_contents / uint_contents are 32-bit on the wire; narrower types must still fit.
        if count and not dtypes.fits(datatype, min(values), max(values)):
            raise InvalidArgumentError(f"input '{tensor.name}': value out of range for {datatype.wire}")
        array = np.array(values, dtype=datatype.numpy)
    return array.reshape(tuple(tensor.shape))


def infer_request_from_proto(
    message: pb.ModelInferRequest, raw_contents: Sequence[memoryview] | None = None
) -> InferRequest:
    """ModelInferRequest -> InferRequest; `raw_contents`, when given, replace the message's raw_input_contents
    (views of the received bytes, which `parse_infer_request` took out of it), and are not copied."""
    raw: Sequence[bytes | memoryview] = message.raw_input_contents if raw_contents is None else raw_contents
    # Inputs in shared memory have no raw entry; every other input has one, in order.
    carried = [i for i, t in enumerate(message.inputs) if "shared_memory_region" not in t.parameters]
    if raw and len(raw) != len(carried):
        raise InvalidArgumentError(
            f"expected {len(carried)} entries in raw_input_contents, one per input, got {len(raw)}"
        )
    raw_index = {input_index: position for position, input_index in enumerate(carried)}
    inputs = []
    for index, tensor in enumerate(message.inputs):
        datatype = dtypes.from_wire(tensor.datatype)
        shape = tuple(tensor.shape)
        if any(dim < 0 for dim in shape):
            raise InvalidArgumentError(
                f"'shape' of input '{tensor.name}' must not hold negative dimensions, got {list(shape)}"
            )
        parameters = parameters_from_proto(tensor.parameters)
        data: np.ndarray | memoryview
        if "shared_memory_region" in parameters:
            data = memoryview(b"")  # read from the client's region during validation
        elif raw:
            if tensor.HasField("contents"):
                raise InvalidArgumentError(
                    f"input '{tensor.name}' has 'contents' but the request uses raw_input_contents"
                    "; use one or the other"
                )
            data = memoryview(raw[raw_index[index]])
        else:
            data = _typed_contents(tensor, datatype)
        inputs.append(InferInput(tensor.name, datatype.wire, shape, data, parameters))
    outputs = tuple(RequestedOutput(o.name, parameters_from_proto(o.parameters)) for o in message.outputs)
    return InferRequest(
        model_name=message.model_name,
        model_version=message.model_version,
        inputs=tuple(inputs),
        outputs=outputs,
        id=message.id,
        parameters=parameters_from_proto(message.parameters),
    )


def infer_reply(response: InferResponse) -> InferReply:
    """Outputs always travel in raw_output_contents, one entry per output in order (what clients decode);
    they stay views of the outputs until the reply is serialized."""
    message = pb.ModelInferResponse(
        model_name=response.model_name, model_version=response.model_version, id=response.id
    )
    for key, value in response.parameters.items():
        _set_parameter(message.parameters[key], value)
    raw: list[bytes | memoryview] = []
    for tensor in response.outputs:
        message.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
        # In shared memory, the data is in the client's region.
        raw.append(b"" if tensor.in_shared_memory else bytes_codec.wire_bytes(tensor.datatype, tensor.data))
    return InferReply(message, tuple(raw))


def metadata_to_proto(metadata: ModelMetadata) -> pb.ModelMetadataResponse:
    message = pb.ModelMetadataResponse(name=metadata.name, versions=metadata.versions, platform=metadata.platform)
    for tensor in metadata.inputs:
        message.inputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
    for tensor in metadata.outputs:
        message.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
    return message
