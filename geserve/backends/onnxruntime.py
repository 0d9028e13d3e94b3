"""ONNX Runtime backend: runs model.onnx and completes configs from the ONNX graph."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from geserve._generated import model_config_pb2 as mc
from geserve.backends.base import OutputAllocator
from geserve.backends.completion import complete_tensors
from geserve.backends.onnxruntime_options import ort_error_text, session_setup
from geserve.codecs import bytes as bytes_codec
from geserve.codecs import dtypes
from geserve.errors import ModelLoadError
from geserve.repository import sequence

logger = logging.getLogger(__name__)

# Triton's --backend-config=default-max-batch-size default.
DEFAULT_MAX_BATCH_SIZE = 4


@dataclass(frozen=True, slots=True)
class _GraphTensor:
    name: str
    datatype: dtypes.DataType | None
    type_name: str
    dims: tuple[int, ...]  # -1 for symbolic or unknown dimensions


class OnnxRuntimeBackend:
    """One onnxruntime.InferenceSession."""

    def __init__(self) -> None:
        self._session: Any = None
        self._run_options: Any = None
        self._inputs: list[_GraphTensor] = []
        self._outputs: list[_GraphTensor] = []
        self._string_inputs: set[str] = set()
        self._string_outputs: set[str] = set()

    def load(self, config: mc.ModelConfig, model_path: Path, device_id: int) -> None:
        import onnxruntime as ort

        if not model_path.exists():
            raise ModelLoadError(f"model '{config.name}': model file '{model_path}' does not exist")
        if model_path.is_dir():
            model_path = model_path / "model.onnx"
        setup = session_setup(config, device_id, ort.get_available_providers())
        self._run_options = setup.run_options
        try:
            self._session = ort.InferenceSession(str(model_path), sess_options=setup.options, providers=setup.providers)
        except Exception as error:  # ORT raises its own exception types for bad files
            raise ModelLoadError(
                f"model '{config.name}': onnxruntime failed to load '{model_path}': {ort_error_text(error)}"
            ) from None
        self._inputs = [_graph_tensor(node) for node in self._session.get_inputs()]
        self._outputs = [_graph_tensor(node) for node in self._session.get_outputs()]
        self._string_inputs = {t.name for t in self._inputs if t.type_name == "tensor(string)"}
        self._string_outputs = {t.name for t in self._outputs if t.type_name == "tensor(string)"}

    def complete_config(self, config: mc.ModelConfig, auto_complete: bool) -> None:
        if auto_complete:
            self._auto_complete(config)
        self._check(config)

    def _auto_complete(self, config: mc.ModelConfig) -> None:
        graph = self._inputs + self._outputs
        batchable = all(len(t.dims) >= 1 and t.dims[0] == -1 for t in graph)
        if config.max_batch_size == 0 and not config.input and batchable:
            config.max_batch_size = DEFAULT_MAX_BATCH_SIZE
            if config.WhichOneof("scheduling_choice") is None:
                config.dynamic_batching.SetInParent()
        skip = 1 if config.max_batch_size > 0 else 0
        # Control and state tensors are the sequence batcher's, never the client's.
        served = sequence.control_and_state_inputs(config)
        kept = sequence.state_outputs(config)
        for declared, graph, hidden in ((config.input, self._inputs, served), (config.output, self._outputs, kept)):
            listed = [t for t in graph if t.name not in hidden]
            if not declared:
                for tensor in listed:
                    declared.add(name=tensor.name)
            complete_tensors(declared, {t.name: t for t in listed}.get, skip)

    def _check(self, config: mc.ModelConfig) -> None:
        skip = 1 if config.max_batch_size > 0 else 0
        for kind, declared, graph in (
            ("input", config.input, self._inputs),
            ("output", config.output, self._outputs),
        ):
            by_name = {t.name: t for t in graph}
            for tensor in declared:
                found = by_name.get(tensor.name)
                if found is None:
                    raise ModelLoadError(
                        f"model '{config.name}': config {kind} '{tensor.name}' is not in the model file, "
                        f"whose {kind}s are {sorted(by_name)}"
                    )
                _check_tensor(config.name, kind, tensor, found, skip)
        declared_inputs = {t.name for t in config.input} | self._check_sequence_inputs(config)
        missing = [t.name for t in self._inputs if t.name not in declared_inputs]
        if missing:
            raise ModelLoadError(f"model '{config.name}': model file inputs {missing} are missing from the config")

    def _check_sequence_inputs(self, config: mc.ModelConfig) -> set[str]:
        """The control and state inputs the sequence batcher feeds, each in the model file with its data type."""
        if not config.HasField("sequence_batching"):
            return set()
        settings = sequence.settings_of(config)
        expected: dict[str, dtypes.DataType] = {}
        for control in (settings.start, settings.end, settings.ready, settings.correlation):
            if control is not None:
                expected[control.name] = control.datatype
        for state in config.sequence_batching.state:
            expected[state.input_name] = dtypes.from_config(state.data_type)
        by_name = {t.name: t for t in self._inputs}
        for name, datatype in expected.items():
            found = by_name.get(name)
            if found is None:
                raise ModelLoadError(
                    f"model '{config.name}': sequence batching input '{name}' is not in the model file, "
                    f"whose inputs are {sorted(by_name)}"
                )
            if found.datatype is not None and found.datatype.config != datatype.config:
                raise ModelLoadError(
                    f"model '{config.name}': sequence batching input '{name}' is {datatype.config_name} in the "
                    f"config but {found.datatype.config_name} in the model file"
                )
        outputs = {t.name for t in self._outputs}
        for state in config.sequence_batching.state:
            if state.output_name not in outputs:
                raise ModelLoadError(
                    f"model '{config.name}': state output '{state.output_name}' is not in the model file, "
                    f"whose outputs are {sorted(outputs)}"
                )
        return set(expected)

    def execute(
        self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str], allocate: OutputAllocator | None = None
    ) -> dict[str, np.ndarray]:
        feeds = {
            name: (_as_str_array(array) if name in self._string_inputs else array) for name, array in inputs.items()
        }
        results = self._session.run(list(output_names), feeds, self._run_options)
        outputs: dict[str, np.ndarray] = {}
        for name, result in zip(output_names, results, strict=True):
            array = np.asarray(result)
            outputs[name] = bytes_codec.to_bytes_array(array) if name in self._string_outputs else array
        return outputs

    def unload(self) -> None:
        self._session = None


def _graph_tensor(node: Any) -> _GraphTensor:
    shape = tuple(dim if isinstance(dim, int) and dim >= 0 else -1 for dim in (node.shape or ()))
    return _GraphTensor(node.name, dtypes.from_onnx(node.type), node.type, shape)


def _check_tensor(model: str, kind: str, tensor: Any, found: _GraphTensor, skip: int) -> None:
    if found.datatype is None:
        raise ModelLoadError(
            f"model '{model}': {kind} '{found.name}' has type {found.type_name}, which is not supported"
        )
    if tensor.data_type != found.datatype.config:
        declared = dtypes.from_config(tensor.data_type).config_name if tensor.data_type else "TYPE_INVALID"
        raise ModelLoadError(
            f"model '{model}': {kind} '{tensor.name}' is {declared} in the config but "
            f"{found.datatype.config_name} in the model file"
        )
    if not found.dims:
        return  # the graph leaves the rank unknown
    expected = list(tensor.reshape.shape) if tensor.HasField("reshape") else list(tensor.dims)
    graph_dims = list(found.dims[skip:]) if len(found.dims) >= skip else None
    if skip and found.dims[0] != -1:
        raise ModelLoadError(
            f"model '{model}': {kind} '{tensor.name}' has fixed first dimension {found.dims[0]} in the model file, "
            "so the model cannot batch; set max_batch_size to 0"
        )
    compatible = graph_dims is not None and len(graph_dims) == len(expected)
    if compatible and graph_dims is not None:
        compatible = all(g == -1 or e == -1 or g == e for g, e in zip(graph_dims, expected, strict=True))
    if not compatible:
        batch = "[-1] + " if skip else ""
        raise ModelLoadError(
            f"model '{model}': {kind} '{tensor.name}' has dims {batch}{expected} in the config but shape "
            f"{list(found.dims)} in the model file"
        )


def _as_str_array(array: np.ndarray) -> np.ndarray:
    # ONNX Runtime string tensors take str elements; BYTES arrive as bytes.
    out = np.empty(array.shape, dtype=np.object_)
    flat = out.reshape(-1)
    for index, item in enumerate(array.reshape(-1)):
        flat[index] = item.decode("utf-8", errors="surrogateescape") if isinstance(item, bytes) else str(item)
    return out


def create_backend() -> OnnxRuntimeBackend:
    return OnnxRuntimeBackend()
