"""A model.onnx's inputs (names and dims) for its ATC command: the config's checked against them, or taken from them."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from geserve._generated import model_config_pb2 as mc
from geserve.atc import graph_shapes
from geserve.errors import ModelLoadError

if TYPE_CHECKING:
    from onnx import ValueInfoProto

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Described:
    """The config ATC's command is built from, with what was taken from the graph to build it."""

    config: mc.ModelConfig
    warnings: tuple[str, ...] = ()  # inputs whose batch dim the graph gave
    unchecked: str = ""  # why the config's inputs were not checked against the graph; "" when they were


def complete_inputs(config: mc.ModelConfig, onnx: Path) -> mc.ModelConfig:
    """`describe`'s config, its warnings logged."""
    described = describe(config, onnx)
    for warning in described.warnings:
        logger.warning("%s", warning)
    if described.unchecked:
        logger.info("%s", described.unchecked)
    return described.config


def describe(config: mc.ModelConfig, onnx: Path) -> Described:
    """The config's inputs checked against the graph's and given the batch dim a config written for Triton's GE
    backend leaves out (`graph_shapes.fit`), or the graph's inputs when the config lists none (as Triton's ONNX
    configs may leave them to auto-complete): the first dim is the batch when max_batch_size > 0; symbolic dims
    stay -1, which the command refuses naming the input."""
    if config.input:
        try:
            graph = read(onnx, config.name)
        except ModelLoadError as error:  # ATC may read what onnxruntime cannot (operators it alone has)
            return Described(config, unchecked=f"{error.message}; its config inputs go to ATC unchecked")
        if graph is None:
            return Described(
                config,
                unchecked=f"model '{config.name}': config inputs go to ATC unchecked against '{onnx}': reading its "
                "graph takes onnx or onnxruntime (geserve[onnx])",
            )
        fitted, warnings = graph_shapes.fit(config, graph, onnx)
        return Described(fitted, tuple(warnings))
    graph = read(onnx, config.name)
    if graph is None:
        raise ModelLoadError(
            f"model '{config.name}': compiling model.onnx with ATC needs its inputs' names and dims: list them in "
            "config.pbtxt (or install onnxruntime, geserve[onnx], so they are read from the file)"
        )
    completed = mc.ModelConfig()
    completed.CopyFrom(config)
    for tensor in graph:
        dims = list(tensor.dims)
        if config.max_batch_size > 0:
            dims = dims[1:]
        completed.input.add(name=tensor.name, dims=dims)
    return Described(completed)


def read(onnx: Path, model: str) -> list[graph_shapes.GraphInput] | None:
    """The graph's inputs, initializers left out: read with the onnx package (a parse, whatever operators the
    graph uses), else with onnxruntime; None when neither is installed."""
    try:
        import onnx as onnx_package
    except ImportError:
        return _read_with_onnxruntime(onnx, model)
    try:
        proto = onnx_package.load(str(onnx), load_external_data=False)
    except Exception as error:  # protobuf's DecodeError, OSError
        raise ModelLoadError(f"model '{model}': cannot read the inputs of '{onnx}': {error}") from None
    initializers = {tensor.name for tensor in proto.graph.initializer}
    return [
        graph_shapes.GraphInput(value.name, _dims(value))
        for value in proto.graph.input
        if value.name not in initializers
    ]


def _dims(value: ValueInfoProto) -> tuple[int, ...]:
    tensor_type = value.type.tensor_type
    if not tensor_type.HasField("shape"):
        return ()
    return tuple(dim.dim_value if dim.dim_value > 0 else -1 for dim in tensor_type.shape.dim)


def _read_with_onnxruntime(onnx: Path, model: str) -> list[graph_shapes.GraphInput] | None:
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # only the inputs are wanted
    try:
        session = ort.InferenceSession(str(onnx), options, providers=["CPUExecutionProvider"])
    except Exception as error:  # onnxruntime raises its own exception types for unreadable files
        raise ModelLoadError(f"model '{model}': cannot read the inputs of '{onnx}': {error}") from None
    return [
        graph_shapes.GraphInput(
            tensor.name, tuple(d if isinstance(d, int) and d > 0 else -1 for d in tensor.shape or ())
        )
        for tensor in session.get_inputs()
    ]
