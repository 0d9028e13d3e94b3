"""A model.onnx's inputs (names and dims), for an ATC command whose config lists no inputs."""

from __future__ import annotations

from pathlib import Path

from geserve._generated import model_config_pb2 as mc
from geserve.errors import ModelLoadError


def complete_inputs(config: mc.ModelConfig, onnx: Path) -> mc.ModelConfig:
    """`config` with the graph's inputs when it lists none (as Triton's ONNX configs may leave them to
    auto-complete): the first dim is the batch when max_batch_size > 0; symbolic dims stay -1, which the
    command refuses naming the input."""
    if config.input:
        return config
    try:
        import onnxruntime as ort
    except ImportError:
        raise ModelLoadError(
            f"model '{config.name}': compiling model.onnx with ATC needs its inputs' names and dims: list them in "
            "config.pbtxt (or install onnxruntime, geserve[onnx], so they are read from the file)"
        ) from None
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # only the inputs are wanted
    try:
        session = ort.InferenceSession(str(onnx), options, providers=["CPUExecutionProvider"])
    except Exception as error:  # onnxruntime raises its own exception types for unreadable files
        raise ModelLoadError(f"model '{config.name}': cannot read the inputs of '{onnx}': {error}") from None
    completed = mc.ModelConfig()
    completed.CopyFrom(config)
    for tensor in session.get_inputs():
        dims = [d if isinstance(d, int) and d > 0 else -1 for d in tensor.shape]
        if config.max_batch_size > 0:
            dims = dims[1:]
        completed.input.add(name=tensor.name, dims=dims)
    return completed
