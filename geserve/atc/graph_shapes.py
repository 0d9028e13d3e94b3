"""A config's input shapes checked against the ONNX graph's for ATC; the batch dim a GE-backend config leaves out."""

# ATC takes --input_shape as the input's shape whatever the graph says, once its rank is the graph input's
# (Ascend/parser parser/onnx/onnx_data_parser.cc, OnnxDataParser::ParseInputFromUser: PARAM_INVALID when the
# ranks differ, the graph's dims replaced otherwise; a graph input without a shape takes any rank). A fixed graph
# dim given another value gets past the parser, into a graph whose ops (a Reshape to a constant shape, weights
# of a fixed size) were built for the graph's value: refused here, before it fails or compiles something else.

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from geserve._generated import model_config_pb2 as mc
from geserve.atc import command
from geserve.errors import ModelLoadError

# The batch dim ATC compiles for a graph that leaves it open, where the config does not batch (max_batch_size 0):
# each request is one whole tensor.
UNBATCHED_BATCH = 1


@dataclass(frozen=True, slots=True)
class GraphInput:
    name: str
    dims: tuple[int, ...]  # -1 where the graph leaves a dim open (symbolic or unknown); () where it gives no shape


def fit(config: mc.ModelConfig, graph: Sequence[GraphInput], onnx: Path) -> tuple[mc.ModelConfig, list[str]]:
    """`config` with each input's shape as ATC is to compile it, and a warning for each input whose batch dim
    was taken from the graph (set as its `reshape`, which --input_shape gives); ModelLoadError for an input
    ATC would refuse or compile as the graph does not describe it."""
    shapes = {tensor.name: list(tensor.dims) for tensor in graph}
    fitted = mc.ModelConfig()
    fitted.CopyFrom(config)
    batch = (-1 if len(command.gears(config)) > 1 else 1) if config.max_batch_size > 0 else None
    warnings = []
    for tensor in fitted.input:
        if tensor.name not in shapes:
            raise ModelLoadError(
                f"model '{config.name}': config input '{tensor.name}' is not an input of '{onnx}', whose inputs "
                f"are {sorted(shapes)}"
            )
        graph_dims = shapes[tensor.name]
        if not graph_dims:
            continue
        model_dims = list(tensor.reshape.shape) if tensor.HasField("reshape") else list(tensor.dims)
        # A config without max_batch_size whose dims leave out the graph's first dim, as configs written for
        # Triton's GE backend give them; the .om's batch dim then completes max_batch_size (acl/completion.py).
        inferred = batch is None and not tensor.HasField("reshape") and len(model_dims) == len(graph_dims) - 1
        if batch is not None:
            atc_dims, how = [batch, *model_dims], f"dims {model_dims} after batch dim {batch}"
        elif inferred:
            first = graph_dims[0] if graph_dims[0] > 0 else UNBATCHED_BATCH
            source = "the graph's" if graph_dims[0] > 0 else "the graph leaves it open"
            atc_dims, how = [first, *model_dims], f"dims {model_dims} after batch dim {first}, {source}"
        else:
            atc_dims, how = model_dims, f"{'reshape' if tensor.HasField('reshape') else 'dims'} {model_dims}"
        given = f"config input '{tensor.name}' gives ATC --input_shape={tensor.name}:{_csv(atc_dims)} ({how})"
        declared = f"input '{tensor.name}' of '{onnx}' has shape {graph_dims}"
        included = batch is not None and len(model_dims) == len(graph_dims)
        hint = "; with max_batch_size > 0, dims leave the batch dim out" if included else ""
        if batch is not None and len(atc_dims) == len(graph_dims) and 0 < graph_dims[0] != batch:
            # The ONNX Runtime backend's words for the same graph (backends/onnxruntime.py _check_tensor).
            raise ModelLoadError(
                f"model '{config.name}': {given}, but input '{tensor.name}' has fixed first dimension "
                f"{graph_dims[0]} in '{onnx}' (shape {graph_dims}), so the model cannot batch; set max_batch_size to 0"
            )
        _check(config.name, given, declared, atc_dims, graph_dims, hint=hint)
        if not inferred:
            continue
        tensor.reshape.shape.extend(atc_dims)
        one_short = (
            f"model '{config.name}': config input '{tensor.name}' has dims {model_dims} and no max_batch_size, one "
            f"dim short of input '{tensor.name}' of '{onnx}' (shape {graph_dims})"
        )
        preferred = list(config.dynamic_batching.preferred_batch_size) if config.HasField("dynamic_batching") else []
        too_large = [size for size in preferred if size > atc_dims[0]]
        if too_large:
            raise ModelLoadError(
                f"{one_short}, so ATC compiles it with batch dim {atc_dims[0]}, smaller than preferred_batch_size "
                f"{too_large}; give max_batch_size (ATC then compiles batch gears where the graph leaves the batch "
                "open) or preferred sizes that the graph's batch dim holds"
            )
        warnings.append(f"{one_short}: {_inferred(tensor.name, model_dims, graph_dims, atc_dims)}")
    return fitted, warnings


def _check(model: str, given: str, declared: str, atc_dims: list[int], graph_dims: list[int], *, hint: str) -> None:
    if len(atc_dims) != len(graph_dims):
        raise ModelLoadError(
            f"model '{model}': {given}, {len(atc_dims)} dims, but {declared}, {len(graph_dims)} dims; ATC refuses "
            f"an input shape whose rank is not the graph's{hint}"
        )
    for index, (wanted, fixed) in enumerate(zip(atc_dims, graph_dims, strict=True)):
        if fixed > 0 and wanted not in (fixed, -1):  # a -1 the config gives is refused by the command
            raise ModelLoadError(
                f"model '{model}': {given}, but {declared}: dim {index} is {wanted} where the graph fixes it at {fixed}"
            )


def _inferred(name: str, dims: list[int], graph_dims: list[int], atc_dims: list[int]) -> str:
    batch = atc_dims[0]
    why = (
        "the graph's fixed batch dim"
        if graph_dims[0] > 0
        else f"a batch of {batch}, as the graph leaves its first dim open and a config without max_batch_size "
        "batches no requests (give max_batch_size to compile batch gears instead)"
    )
    rows = "1" if batch == 1 else "n"
    sent = f"[{', '.join(str(d) for d in [rows, *dims])}]{'' if batch == 1 else f' with n up to {batch}'}"
    return (
        f"ATC compiles it as --input_shape={name}:{_csv(atc_dims)}, {why}; as for a shipped .om of that shape, load "
        f"then completes max_batch_size to {batch} (auto-complete, where the .om's outputs lead with the same batch "
        f"dim) and clients send {sent}"
    )


def _csv(dims: Sequence[int]) -> str:
    return ",".join(str(d) for d in dims)
