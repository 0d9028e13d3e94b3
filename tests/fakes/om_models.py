"""Small ONNX graphs as real-format `.om` files (with their ONNX twins), for the Ascend backend's tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from geserve.backends.acl.description import DYNAMIC_AIPP_TENSOR_NAME, DYNAMIC_TENSOR_NAME
from tests.fakes.acl.om import twin_path
from tests.fakes.om_writer import write_om
from tests.support import config_text

FEATURES = 4


def onnx_bytes(graph: onnx.GraphProto) -> bytes:
    """`graph` as a checked ONNX model (opset 17, IR version 8), serialized: what an `.om` twin holds."""
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


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
    return onnx_bytes(graph)


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


def affine_config(name: str, max_batch_size: int, extra: str) -> str:
    """The config.pbtxt of the affine graph served by the `ge` backend: x in; y and s out."""
    return config_text(
        name,
        backend="ge",
        max_batch_size=max_batch_size,
        inputs=[("x", "TYPE_FP32", str(FEATURES))],
        outputs=[("y", "TYPE_FP32", str(FEATURES)), ("s", "TYPE_FP32", "1")],
        extra=extra,
    )


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


def aipp_description(height: int = 16, width: int = 16, soc_version: str = "Ascend310P3") -> dict[str, Any]:
    """A classifier compiled with a static AIPP config (`input_format: YUV420SP_U8`, `src_image_size_h/w`):
    its input takes the YUV420SP image as uint8 bytes. get_input_dims reports the image's n,h,w,c and
    get_input_dims_v2 the buffer's n,h*1.5,w,1, whose product is get_input_size_by_index (CANN docs,
    aclmdlGetInputDimsV2, table 1)."""
    return {
        "name": "aipp_classifier",
        "soc_version": soc_version,
        "inputs": [
            {
                "name": "image",
                "dtype": "uint8",
                "dims": [1, height, width, 3],
                "dims_v2": [1, height * 3 // 2, width, 1],
                "format": "NHWC",
            }
        ],
        "outputs": [{"name": "prob:0", "dtype": "float32", "dims": [1, 10], "format": "ND"}],
        "dynamic": None,
    }


def dynamic_aipp_description(soc_version: str = "Ascend310P3") -> dict[str, Any]:
    """A model compiled with a dynamic AIPP config: ATC adds the `ascend_dynamic_aipp_data` input, which
    pyACL fills from an aclmdlAIPP object (its dims here are this test's; GE sizes it from the config)."""
    description = aipp_description(soc_version=soc_version)
    image = description["inputs"][0]
    del image["dims_v2"]
    description["inputs"].append({"name": DYNAMIC_AIPP_TENSOR_NAME, "dtype": "uint8", "dims": [1, 256], "format": "ND"})
    return description
