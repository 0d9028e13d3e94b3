"""Small ONNX graphs as real-format `.om` files (with their ONNX twins), for the Ascend backend's tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from geserve.backends.acl.description import DYNAMIC_TENSOR_NAME
from tests.fakes.acl.om import twin_path
from tests.fakes.om_writer import write_om

FEATURES = 4


def affine_onnx(features: int = FEATURES, batch: int | str = "batch") -> bytes:
    """y = 2x + 1 and s = the row sums of x, for FP32 x of shape [batch, features]."""
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["x", "two"], ["doubled"]),
            helper.make_node("Add", ["doubled", "one"], ["y"]),
            helper.make_node("ReduceSum", ["x", "axes"], ["s"], keepdims=1),
        ],
        "affine",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, features])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, features]),
            helper.make_tensor_value_info("s", TensorProto.FLOAT, [batch, 1]),
        ],
        [
            numpy_helper.from_array(np.array(2.0, dtype=np.float32), "two"),
            numpy_helper.from_array(np.array(1.0, dtype=np.float32), "one"),
            numpy_helper.from_array(np.array([1], dtype=np.int64), "axes"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def affine_reference(x: np.ndarray) -> dict[str, np.ndarray]:
    """The graph's outputs, run directly with onnxruntime."""
    import onnxruntime as ort

    session = ort.InferenceSession(affine_onnx(), providers=["CPUExecutionProvider"])
    y, s = session.run(["y", "s"], {"x": x})
    return {"y": y, "s": s}


def affine_description(gears: list[int] | None = None, static_batch: int | None = None) -> dict[str, Any]:
    """The affine graph as ATC describes it: outputs renamed `<node>:<index>:<onnx name>`, batch gears
    with -1 input dims, the largest gear's output dims and the `ascend_mbatch_shape_data` input."""
    batch = max(gears) if gears else static_batch or 1
    first = -1 if gears else batch
    inputs = [{"name": "x", "dtype": "float32", "dims": [first, FEATURES], "format": "ND"}]
    if gears:
        inputs.append({"name": DYNAMIC_TENSOR_NAME, "dtype": "int32", "dims": [1], "format": "ND"})
    return {
        "name": "affine",
        "soc_version": "Ascend310P3",
        "inputs": inputs,
        "outputs": [
            {"name": "Add_1:0:y", "dtype": "float32", "dims": [batch, FEATURES], "format": "ND"},
            {"name": "ReduceSum_2:0:s", "dtype": "float32", "dims": [batch, 1], "format": "ND"},
        ],
        "dynamic": {"dynamic_batch": sorted(gears), "data_name_order": ["x"]} if gears else None,
    }


def write_affine_om(path: Path, gears: list[int] | None = None, static_batch: int | None = None) -> Path:
    """A real-format `.om` of the affine graph, with its ONNX twin beside it for the simulator to run."""
    write_om(path, affine_description(gears, static_batch))
    batch: int | str = "batch" if gears else static_batch or 1
    twin_path(path).write_bytes(affine_onnx(batch=batch))
    return path


def resnet50_description(gears: list[int], name: str = "resnet50") -> dict[str, Any]:
    """ResNet-50 as ATC compiles its ONNX export with --dynamic_batch_size: the output renamed
    `<node>:<index>:<onnx name>`, the runtime-filled batch input added, outputs at the largest gear."""
    return {
        "name": name,
        "soc_version": "Ascend310P3",
        "inputs": [
            {"name": "input", "dtype": "float32", "dims": [-1, 3, 224, 224], "format": "NCHW"},
            {"name": DYNAMIC_TENSOR_NAME, "dtype": "int32", "dims": [1], "format": "ND"},
        ],
        "outputs": [{"name": "Gemm_174:0:output", "dtype": "float32", "dims": [max(gears), 1000], "format": "ND"}],
        "dynamic": {"dynamic_batch": gears, "data_name_order": ["input"]},
    }
