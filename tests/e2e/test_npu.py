"""On real Ascend hardware only: a compiled `.om` served through pyACL, checked through tritonclient.

`make npu-check GESERVE_NPU_OM=/path/model.om [GESERVE_NPU_ONNX=/path/model.onnx]
[GESERVE_NPU_DEVICES=0,1]` after sourcing CANN's set_env.sh. With GESERVE_NPU_ONNX (the model the
.om was compiled from) outputs are compared with onnxruntime's, by the config's names, to fp16
tolerance (tests/npu_twin.py: a twin with a fixed batch dim runs row by row, fp16 inputs are cast to the
twin's fp32). `make npu-check` runs scripts/npu_preflight.py first and sets GESERVE_NPU_REQUIRED=1, which turns
every skip into a failure.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import triton_to_np_dtype

from geserve._generated import model_config_pb2 as mc
from geserve.backends.acl.om_file import read_description
from tests.npu_twin import assert_matches_twin, by_config_names, first_device_id, open_twin, run_twin
from tests.support import GeserveProcess

FAKES = Path(__file__).resolve().parents[1] / "fakes"
# A cold .om load (graph load, kernel upload) takes minutes on a busy host, not pytest's 120 s.
LOAD_TIMEOUT_S = 900


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


_REASON = _real_acl()
if _REASON and os.environ.get("GESERVE_NPU_REQUIRED") == "1":
    raise RuntimeError(f"make npu-check cannot run: {_REASON}")

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.npu,
    pytest.mark.one_layout,
    pytest.mark.skipif(bool(_REASON), reason=_REASON or "-"),
    pytest.mark.timeout(1800),
]

Launch = Callable[..., GeserveProcess]


def test_pyacl_describes_the_om_as_the_offline_reader_does() -> None:
    from geserve.backends.acl import AclBackend

    path = Path(os.environ["GESERVE_NPU_OM"])
    backend = AclBackend()
    # The device make npu-check was pointed at: device 0 may be another user's, or not this container's.
    backend.load(mc.ModelConfig(name="npu_model"), path, first_device_id(os.environ.get("GESERVE_NPU_DEVICES", "")))
    try:
        runtime = backend._require_model()
    finally:
        backend.unload()
    offline = read_description(path)

    def tensors(om: Any) -> list[tuple[str, int, int, tuple[int, ...], str]]:
        every = [*om.inputs, *([om.dynamic_input] if om.dynamic_input else []), *om.outputs]
        return [(t.name, t.index, t.acl_type, t.dims, t.format) for t in every]

    assert tensors(runtime) == tensors(offline)
    assert runtime.gears == offline.gears


@pytest.fixture(scope="module")
def npu_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GeserveProcess]:
    root = tmp_path_factory.mktemp("npu")
    repository = root / "models"
    (repository / "npu_model" / "1").mkdir(parents=True)
    shutil.copy(os.environ["GESERVE_NPU_OM"], repository / "npu_model" / "1" / "model.om")
    devices = os.environ.get("GESERVE_NPU_DEVICES", "0")
    process = GeserveProcess(
        root / "geserve.log", f"--model-repository={repository}", f"--device-ids={devices}", "--metrics-interval-ms=200"
    ).wait_live(timeout_s=LOAD_TIMEOUT_S)
    yield process
    assert process.stop() == 0, process.log()


def _batches(config: dict[str, Any]) -> list[int]:
    """Every gear and every size between (a batch of rows pads to the next gear); [0]: no batch dim."""
    if not config["max_batch_size"]:
        return [0]
    return list(range(1, config["max_batch_size"] + 1))


def test_every_gear_over_http_and_grpc_matches_the_onnx_twin(npu_server: GeserveProcess) -> None:
    twin = open_twin(os.environ["GESERVE_NPU_ONNX"]) if os.environ.get("GESERVE_NPU_ONNX") else None
    _check_every_gear(npu_server, "npu_model", twin)


def _check_every_gear(server: GeserveProcess, model: str, twin: Any) -> None:
    """Every gear (and size between) over HTTP and gRPC: outputs of the served shapes, equal to the twin's."""
    http = httpclient.InferenceServerClient(server.url, network_timeout=600)
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    config = http.get_model_config(model)
    metadata = http.get_model_metadata(model)
    rng = np.random.default_rng(0)
    for batch in _batches(config):
        arrays = {}
        for tensor in metadata["inputs"]:
            shape = [batch if dim == -1 else dim for dim in tensor["shape"]]
            dtype = triton_to_np_dtype(tensor["datatype"])
            if np.issubdtype(dtype, np.floating):
                arrays[tensor["name"]] = rng.uniform(0, 1, size=shape).astype(dtype)
            elif dtype == np.bool_:
                arrays[tensor["name"]] = rng.integers(0, 2, size=shape).astype(dtype)
            else:
                arrays[tensor["name"]] = rng.integers(0, 100, size=shape).astype(dtype)
        results = []
        http_inputs = [
            httpclient.InferInput(t["name"], list(arrays[t["name"]].shape), t["datatype"]) for t in metadata["inputs"]
        ]
        grpc_inputs = [
            grpcclient.InferInput(t["name"], list(arrays[t["name"]].shape), t["datatype"]) for t in metadata["inputs"]
        ]
        for http_input, grpc_input in zip(http_inputs, grpc_inputs, strict=True):
            http_input.set_data_from_numpy(arrays[http_input.name()], binary_data=True)
            grpc_input.set_data_from_numpy(arrays[grpc_input.name()])
        results.append(http.infer(model, http_inputs))
        results.append(grpc.infer(model, grpc_inputs))
        reference = by_config_names(config, run_twin(twin, arrays, batch)) if twin is not None else {}
        for result in results:
            for tensor in metadata["outputs"]:
                output = result.as_numpy(tensor["name"])
                assert list(output.shape) == [batch if dim == -1 else dim for dim in tensor["shape"]]
                if np.issubdtype(output.dtype, np.floating):
                    assert np.all(np.isfinite(output))
                if tensor["name"] in reference:
                    assert_matches_twin(tensor["name"], output, reference[tensor["name"]])


def test_geserve_compile_from_a_relative_repository_then_serves_what_onnx_runtime_answers(
    tmp_path: Path,
) -> None:
    """The compile path on this host: `geserve compile` of GESERVE_NPU_ONNX with the repository and cache named
    relative to its working directory (as `make run` names them), then a server that loads the cached `.om` and
    answers as ONNX Runtime does."""
    onnx_file = os.environ.get("GESERVE_NPU_ONNX", "")
    if not onnx_file:
        pytest.skip("GESERVE_NPU_ONNX names no ONNX file to compile")
    twin = open_twin(onnx_file)
    batched = all(not isinstance(tensor.shape[0], int) for tensor in twin.get_inputs())
    (tmp_path / "models" / "compiled" / "1").mkdir(parents=True)
    shutil.copy(onnx_file, tmp_path / "models" / "compiled" / "1" / "model.onnx")
    config = f'name: "compiled" backend: "ge" max_batch_size: {8 if batched else 0}'
    (tmp_path / "models" / "compiled" / "config.pbtxt").write_text(config)
    done = subprocess.run(
        [sys.executable, "-m", "geserve", "compile", "--model-repository", "models", "--model-cache-dir", "cache"],
        cwd=tmp_path, capture_output=True, text=True, timeout=LOAD_TIMEOUT_S, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "compiled version 1: compiled: " in done.stdout, done.stdout
    devices = os.environ.get("GESERVE_NPU_DEVICES", "0")
    server = GeserveProcess(
        tmp_path / "geserve.log",
        f"--model-repository={tmp_path / 'models'}",
        f"--model-cache-dir={tmp_path / 'cache'}",
        f"--device-ids={devices}",
        "--npu=required",
    ).wait_live(timeout_s=LOAD_TIMEOUT_S)
    try:
        assert "using the cached compile" in server.log(), server.log()
        _check_every_gear(server, "compiled", twin)
    finally:
        assert server.stop() == 0, server.log()


def test_npu_metrics_are_exported(npu_server: GeserveProcess) -> None:
    with urllib.request.urlopen(f"http://127.0.0.1:{npu_server.metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    assert re.search(r'\nnv_gpu_memory_total_bytes\{gpu_uuid="NPU-\d+"\} [1-9]\d*', text)
    assert re.search(r'\nnv_gpu_memory_used_bytes\{gpu_uuid="NPU-\d+"\} \d+', text)
    for value in re.findall(r'\nnv_gpu_utilization\{gpu_uuid="NPU-\d+"\} (\S+)', text):
        assert 0.0 <= float(value) <= 1.0  # a field the chip cannot measure is left out, never -1 or 0
