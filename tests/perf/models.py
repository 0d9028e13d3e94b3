"""The benchmark models, built with fixed seeds: identity, simple and mlp, with batching configs."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.support import MODEL_REPOSITORY

IR_VERSION = 9
OPSET = 17
BATCHING = "max_batch_size: 32\ndynamic_batching { }\n"


def _save(model: onnx.ModelProto, folder: Path, name: str, platform: str = "onnxruntime_onnx") -> None:
    onnx.checker.check_model(model)
    (folder / name / "1").mkdir(parents=True, exist_ok=True)
    (folder / name / "1" / "model.onnx").write_bytes(model.SerializeToString(deterministic=True))
    (folder / name / "config.pbtxt").write_text(f'name: "{name}"\nplatform: "{platform}"\n{BATCHING}')


def identity_model() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])],
        "identity",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", 16])],
    )
    return helper.make_model(graph, ir_version=IR_VERSION, opset_imports=[helper.make_opsetid("", OPSET)])


def mlp_model(seed: int = 0) -> onnx.ModelProto:
    """FP32 [-1,512] -> Gemm 512x2048 -> Relu -> Gemm 2048x2048 -> Relu -> Gemm 2048x512."""
    rng = np.random.default_rng(seed)
    sizes = [(512, 2048), (2048, 2048), (2048, 512)]
    initializers, nodes = [], []
    current = "INPUT0"
    for index, (rows, columns) in enumerate(sizes):
        weight = (rng.standard_normal((rows, columns)) / np.sqrt(rows)).astype(np.float32)
        bias = np.zeros(columns, dtype=np.float32)
        initializers += [numpy_helper.from_array(weight, f"w{index}"), numpy_helper.from_array(bias, f"b{index}")]
        output = "OUTPUT0" if index == len(sizes) - 1 else f"gemm{index}"
        nodes.append(helper.make_node("Gemm", [current, f"w{index}", f"b{index}"], [output]))
        if index < len(sizes) - 1:
            nodes.append(helper.make_node("Relu", [output], [f"relu{index}"]))
            current = f"relu{index}"
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", 512])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", 512])],
        initializer=initializers,
    )
    return helper.make_model(graph, ir_version=IR_VERSION, opset_imports=[helper.make_opsetid("", OPSET)])


def build(folder: Path) -> dict[str, dict[str, tuple[str, list[int]]]]:
    """Write the three models; returns each model's inputs as name -> (datatype, dims)."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    _save(identity_model(), folder, "identity")
    _save(mlp_model(), folder, "mlp")
    (folder / "simple" / "1").mkdir(parents=True)
    shutil.copy(MODEL_REPOSITORY / "simple" / "1" / "model.onnx", folder / "simple" / "1" / "model.onnx")
    (folder / "simple" / "config.pbtxt").write_text(f'name: "simple"\nplatform: "onnxruntime_onnx"\n{BATCHING}')
    return {
        "identity": {"INPUT0": ("FP32", [16])},
        "simple": {"INPUT0": ("INT32", [16]), "INPUT1": ("INT32", [16])},
        "mlp": {"INPUT0": ("FP32", [512])},
    }


def sample(datatype: str, dims: list[int], batch: int, seed: int = 1) -> np.ndarray:
    """Real values (perf_analyzer's random floats include NaN and Inf)."""
    rng = np.random.default_rng(seed)
    shape = (batch, *dims)
    if datatype == "INT32":
        return rng.integers(-1000, 1000, size=shape, dtype=np.int32)
    return rng.standard_normal(shape).astype(np.float32)
