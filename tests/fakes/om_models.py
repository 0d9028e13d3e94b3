"""Small ONNX graphs packed as simulated `.om` files, for the Ascend backend's tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.fakes.acl.om import tensor, write_om

ACL_FLOAT, ACL_INT32 = 0, 3
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


def write_affine_om(path: Path, gears: list[int] | None = None, static_batch: int | None = None) -> Path:
    """The affine graph as ATC would compile it: with batch gears (dims -1), or for a fixed batch."""
    first = -1 if gears else static_batch or 1
    onnx_model = affine_onnx(batch="batch" if gears else first)
    return write_om(
        path,
        onnx_model,
        inputs=[tensor("x", ACL_FLOAT, [first, FEATURES])],
        outputs=[tensor("y", ACL_FLOAT, [first, FEATURES]), tensor("s", ACL_FLOAT, [first, 1])],
        dynamic_batch=gears,
    )
