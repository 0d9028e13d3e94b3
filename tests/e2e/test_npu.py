"""On real Ascend hardware only: a compiled `.om` served through pyACL, checked through tritonclient.

Run with `GESERVE_NPU_OM=/path/model.om [GESERVE_NPU_ONNX=/path/model.onnx] [GESERVE_NPU_DEVICES=0,1]
pytest -m npu tests/e2e/test_npu.py` after sourcing CANN's set_env.sh. With GESERVE_NPU_ONNX (the
model the .om was compiled from) outputs are compared with onnxruntime's, to fp16 tolerance.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.support import GeserveProcess

FAKES = Path(__file__).resolve().parents[1] / "fakes"


def _real_acl() -> str:
    """Why these tests cannot run here, or '' when a real pyACL and a real .om are available."""
    om = os.environ.get("GESERVE_NPU_OM", "")
    if not om or not Path(om).is_file():
        return "GESERVE_NPU_OM does not name a compiled .om file"
    spec = importlib.util.find_spec("acl")
    if spec is None or spec.origin is None:
        return "pyACL is not importable (install CANN and source set_env.sh)"
    if Path(spec.origin).resolve().is_relative_to(FAKES):
        return "only the pyACL simulator is importable"
    return ""


pytestmark = [pytest.mark.e2e, pytest.mark.npu, pytest.mark.skipif(bool(_real_acl()), reason=_real_acl() or "-")]

Launch = Callable[..., GeserveProcess]
_NUMPY = {"FP32": np.float32, "FP16": np.float16, "INT32": np.int32, "INT64": np.int64, "UINT8": np.uint8}


def test_real_om_serves_at_batch_one_and_the_largest_gear(launch: Launch, tmp_path: Path) -> None:
    repository = tmp_path / "models"
    (repository / "npu_model" / "1").mkdir(parents=True)
    shutil.copy(os.environ["GESERVE_NPU_OM"], repository / "npu_model" / "1" / "model.om")
    devices = os.environ.get("GESERVE_NPU_DEVICES", "0")
    server = launch(f"--model-repository={repository}", f"--device-ids={devices}", "--metrics-interval-ms=200")
    server.wait_live(timeout_s=300)
    client = httpclient.InferenceServerClient(server.url)
    config = client.get_model_config("npu_model")
    metadata = client.get_model_metadata("npu_model")
    batches = sorted({1, config["max_batch_size"]}) if config["max_batch_size"] else [0]
    rng = np.random.default_rng(0)
    for batch in batches:
        inputs, arrays = [], {}
        for tensor in metadata["inputs"]:
            shape = [batch if dim == -1 else dim for dim in tensor["shape"]]
            array = rng.uniform(0, 1, size=shape).astype(_NUMPY[tensor["datatype"]])
            arrays[tensor["name"]] = array
            inputs.append(httpclient.InferInput(tensor["name"], shape, tensor["datatype"]))
            inputs[-1].set_data_from_numpy(array)
        result = client.infer("npu_model", inputs)
        for tensor in metadata["outputs"]:
            output = result.as_numpy(tensor["name"])
            expected = [batch if dim == -1 else dim for dim in tensor["shape"]]
            assert list(output.shape) == expected
            assert np.all(np.isfinite(output.astype(np.float64)))
        reference = os.environ.get("GESERVE_NPU_ONNX")
        if reference:
            import onnxruntime as ort

            session = ort.InferenceSession(reference, providers=["CPUExecutionProvider"])
            for name, value in zip([o.name for o in session.get_outputs()], session.run(None, arrays), strict=True):
                np.testing.assert_allclose(result.as_numpy(name), value, rtol=2e-2, atol=2e-2)
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    assert re.search(r'\nnv_gpu_memory_total_bytes\{gpu_uuid="NPU-\d+"\} \d+', text)
    assert server.stop() == 0
