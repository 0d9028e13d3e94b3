"""Responses of a model version: outputs reshaped as configured, classification, and client shared memory."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from geserve.codecs import bytes as bytes_codec
from geserve.core.classification import classification_count, classify
from geserve.core.shared_memory import BYTE_SIZE, OFFSET, REGION
from geserve.offload import COPY_BYTES, off_loop
from geserve.residency import SharedTensor
from geserve.snapshots import ServedVersion
from geserve.types import InferRequest, InferResponse, OutputTensor, Parameters


class ClientRegions(Protocol):
    """Client shared-memory regions as a request uses them: the engine's registry, or a protocol process's mirror."""

    def __contains__(self, name: object) -> bool:
        """Whether a region of that name is registered."""
        ...

    def locate(self, parameters: Parameters, what: str, check: Callable[[int], None] | None = None) -> SharedTensor:
        """Where an input lies in its region, for a worker to read it there."""
        ...

    def read(self, parameters: Parameters, what: str, check: Callable[[int], None] | None = None) -> memoryview:
        """A copy of an input's bytes."""
        ...

    def write(self, parameters: Parameters, what: str, data: bytes | memoryview) -> int:
        """Copy an output into its region; returns the bytes written."""
        ...


class ResponseBuilder:
    """Turns a model's outputs into the response a request asked for."""

    def __init__(self, regions: ClientRegions) -> None:
        self._regions = regions

    async def build(
        self,
        model: ServedVersion,
        request: InferRequest,
        output_names: tuple[str, ...],
        outputs: Mapping[str, SharedTensor],
        parameters: Parameters,
    ) -> InferResponse:
        """The response, with classification applied and outputs bound for shared memory written there.
        A python model may leave out outputs it was asked for, as Triton allows."""
        tensors = [_output(model, name, outputs[name]) for name in output_names if name in outputs]
        if request.outputs:
            asked = {output.name: output.parameters for output in request.outputs}
            tensors = [await self._post_process(model, tensor, asked.get(tensor.name, {})) for tensor in tensors]
        return InferResponse(model.name, model.version_str, tuple(tensors), request.id, parameters)

    async def _post_process(self, model: ServedVersion, tensor: OutputTensor, asked: Parameters) -> OutputTensor:
        if "classification" in asked:
            k = classification_count(asked["classification"], tensor.name)
            spec = model.outputs[tensor.name]
            labels = model.labels.get(tensor.name, [])
            tensor = OutputTensor(tensor.name, "BYTES", classify(tensor.data, k, labels, spec.batched, tensor.name))
        if REGION not in asked:
            return tensor
        data = bytes_codec.wire_bytes(tensor.datatype, tensor.data)
        what = f"output '{tensor.name}'"
        written = await off_loop(len(data), COPY_BYTES, self._regions.write, asked, what, data)
        parameters = {REGION: asked[REGION], BYTE_SIZE: written}
        if OFFSET in asked:
            parameters[OFFSET] = asked[OFFSET]
        return OutputTensor(tensor.name, tensor.datatype, tensor.data, parameters)


def _output(model: ServedVersion, name: str, tensor: SharedTensor) -> OutputTensor:
    spec = model.outputs[name]
    if spec.reshape is not None:
        batch = (tensor.shape[0],) if spec.batched and tensor.ndim else ()
        tensor = tensor.reshaped(batch + spec.dims)
    return OutputTensor(name, spec.dtype.wire, tensor.array)
