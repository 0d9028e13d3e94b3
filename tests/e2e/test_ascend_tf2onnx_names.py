"""A tf2onnx export compiled by ATC: every tensor name holds `:`, and a config written with them serves."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto, helper, numpy_helper

from tests.fakes.acl.om import twin_path
from tests.fakes.om_models import onnx_bytes
from tests.fakes.om_writer import write_om
from tests.support import GeserveProcess

pytestmark = [pytest.mark.e2e, pytest.mark.one_layout]

FAKES = Path(__file__).resolve().parents[1] / "fakes"
FEATURES = 3
# What tf2onnx writes for a Keras model: inputs `<name>:0`, outputs the graph's Identity ops, `Identity:0`.
CONFIG = """
name: "keras_export"
backend: "ge"
max_batch_size: 4
input [ { name: "x:0" data_type: TYPE_FP32 dims: [ 3 ] } ]
output [ { name: "Identity:0" data_type: TYPE_FP32 dims: [ 3 ] }, { name: "Identity_1:0" data_type: TYPE_FP32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_GPU count: 1 } ]
"""


def _tf2onnx_graph() -> bytes:
    """Identity:0 = 3x, Identity_1:0 = the row sums of x."""
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["x:0", "three"], ["Identity:0"], name="Identity"),
            helper.make_node("ReduceSum", ["x:0", "axes"], ["Identity_1:0"], name="Identity_1", keepdims=1),
        ],
        "tf2onnx",
        [helper.make_tensor_value_info("x:0", TensorProto.FLOAT, ["unk__6", FEATURES])],
        [
            helper.make_tensor_value_info("Identity:0", TensorProto.FLOAT, ["unk__6", FEATURES]),
            helper.make_tensor_value_info("Identity_1:0", TensorProto.FLOAT, ["unk__6", 1]),
        ],
        [
            numpy_helper.from_array(np.array(3.0, dtype=np.float32), "three"),
            numpy_helper.from_array(np.array([1], dtype=np.int64), "axes"),
        ],
    )
    return onnx_bytes(graph)


def _description() -> dict[str, Any]:
    """As ATC describes the compiled export (static batch 4): `<node>:<index>:<onnx name>` outputs."""
    return {
        "name": "keras_export",
        "soc_version": "Ascend310P3",
        "inputs": [{"name": "x:0", "dtype": "float32", "dims": [4, FEATURES], "format": "ND"}],
        "outputs": [
            {"name": "Identity_node:0:Identity:0", "dtype": "float32", "dims": [4, FEATURES], "format": "ND"},
            {"name": "Identity_1_node:0:Identity_1:0", "dtype": "float32", "dims": [4, 1], "format": "ND"},
        ],
        "dynamic": None,
    }


def test_outputs_named_identity_colon_zero_load_and_serve_over_http_and_grpc(launch: Any, tmp_path: Path) -> None:
    model = tmp_path / "models" / "keras_export"
    om = write_om(model / "1" / "model.om", _description())
    twin_path(om).write_bytes(_tf2onnx_graph())
    (model / "config.pbtxt").write_text(CONFIG)
    env = {"PYTHONPATH": os.pathsep.join([str(FAKES), os.environ.get("PYTHONPATH", "")]), "ACL_SIM_DEVICE_COUNT": "1"}
    server: GeserveProcess = launch(f"--model-repository={tmp_path / 'models'}", "--device-ids=0", env=env)
    server.wait_live()
    x = np.arange(2 * FEATURES, dtype=np.float32).reshape(2, FEATURES)

    http = httpclient.InferenceServerClient(server.url)
    metadata = http.get_model_metadata("keras_export")
    assert [output["name"] for output in metadata["outputs"]] == ["Identity:0", "Identity_1:0"]
    tensor = httpclient.InferInput("x:0", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    result = http.infer("keras_export", [tensor], outputs=[httpclient.InferRequestedOutput("Identity:0")])
    np.testing.assert_array_equal(result.as_numpy("Identity:0"), 3 * x)
    assert result.as_numpy("Identity_1:0") is None  # only the output asked for

    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    tensor = grpcclient.InferInput("x:0", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    result = grpc.infer("keras_export", [tensor])
    np.testing.assert_array_equal(result.as_numpy("Identity:0"), 3 * x)
    np.testing.assert_array_equal(result.as_numpy("Identity_1:0"), x.sum(axis=1, keepdims=True))
    assert server.stop() == 0
