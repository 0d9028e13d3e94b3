"""Responses of a model version: outputs reshaped as configured, classification, and client shared memory."""

from __future__ import annotations

from geserve.codecs import bytes as bytes_codec
from geserve.core.classification import classification_count, classify
from geserve.core.models import ModelVersion
from geserve.core.shared_memory import BYTE_SIZE, OFFSET, REGION, SharedMemoryManager
from geserve.offload import COPY_BYTES, off_loop
from geserve.residency import SharedTensor
from geserve.types import InferRequest, InferResponse, OutputTensor, Parameters, response_parameters


class ResponseBuilder:
    """Turns a model's outputs into the response a request asked for."""

    def __init__(self, shared_memory: SharedMemoryManager) -> None:
        self._shared_memory = shared_memory

    async def build(
        self,
        model: ModelVersion,
        request: InferRequest,
        output_names: tuple[str, ...],
        outputs: dict[str, SharedTensor],
    ) -> InferResponse:
        """The response, with classification applied and outputs bound for shared memory written there.
        A python model may leave out outputs it was asked for, as Triton allows."""
        tensors = [_output(model, name, outputs[name]) for name in output_names if name in outputs]
        if request.outputs:
            asked = {output.name: output.parameters for output in request.outputs}
            tensors = [await self._post_process(model, tensor, asked.get(tensor.name, {})) for tensor in tensors]
        return InferResponse(model.name, model.version_str, tuple(tensors), request.id, response_parameters(outputs))

    async def _post_process(self, model: ModelVersion, tensor: OutputTensor, asked: Parameters) -> OutputTensor:
        if "classification" in asked:
            k = classification_count(asked["classification"], tensor.name)
            spec = model.outputs[tensor.name]
            labels = model.labels.get(tensor.name, [])
            tensor = OutputTensor(tensor.name, "BYTES", classify(tensor.data, k, labels, spec.batched, tensor.name))
        if REGION not in asked:
            return tensor
        data = bytes_codec.wire_bytes(tensor.datatype, tensor.data)
        what = f"output '{tensor.name}'"
        written = await off_loop(len(data), COPY_BYTES, self._shared_memory.write, asked, what, data)
        parameters = {REGION: asked[REGION], BYTE_SIZE: written}
        if OFFSET in asked:
            parameters[OFFSET] = asked[OFFSET]
        return OutputTensor(tensor.name, tensor.datatype, tensor.data, parameters)


def _output(model: ModelVersion, name: str, tensor: SharedTensor) -> OutputTensor:
    spec = model.outputs[name]
    if spec.reshape is not None:
        batch = (tensor.shape[0],) if spec.batched and tensor.ndim else ()
        tensor = tensor.reshaped(batch + spec.dims)
    return OutputTensor(name, spec.dtype.wire, tensor.array)
