"""Serving `.om` models through tritonclient, with the pyACL simulator standing in for CANN and NPUs."""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcclient_aio
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.fakes.om_models import FEATURES, affine_config, affine_reference, write_affine_om
from tests.support import GeserveProcess, config_text, copy_model

pytestmark = [pytest.mark.e2e, pytest.mark.one_layout]

Launch = Callable[..., GeserveProcess]
FAKES = Path(__file__).resolve().parents[1] / "fakes"
GEARS = [1, 2, 4, 8]
# Every pyACL call the backend makes; the leak-check test asserts each was exercised.
BACKEND_CALLS = {
    "init", "rt.set_device", "rt.create_context", "rt.create_stream", "rt.get_run_mode", "get_soc_name",
    "mdl.load_from_file", "mdl.create_desc", "mdl.get_desc", "mdl.get_dynamic_batch", "mdl.get_num_inputs",
    "mdl.get_input_name_by_index", "mdl.get_input_dims", "mdl.get_input_dims_v2", "mdl.get_input_data_type",
    "mdl.get_input_size_by_index",
    "mdl.get_num_outputs", "mdl.get_output_name_by_index", "mdl.get_output_dims", "mdl.get_output_data_type",
    "mdl.get_output_size_by_index", "mdl.create_dataset", "rt.malloc", "create_data_buffer",
    "mdl.add_dataset_buffer", "rt.memcpy", "rt.memset", "update_data_buffer", "mdl.set_dynamic_batch_size",
    "mdl.execute_async", "rt.synchronize_stream_with_timeout", "mdl.get_cur_output_dims", "rt.get_mem_info", "rt.get_device_utilization_rate",
    "destroy_data_buffer", "rt.free", "mdl.destroy_dataset", "mdl.unload", "mdl.destroy_desc",
    "rt.destroy_stream", "rt.destroy_context", "rt.reset_device", "finalize",
}  # fmt: skip

GEARS_CONFIG = affine_config(
    "affine_gears",
    max_batch_size=8,
    extra="instance_group [ { kind: KIND_GPU count: 1 gpus: [ 0, 1 ] } ]\n"
    "dynamic_batching { max_queue_delay_microseconds: 20000 }",
)
STATIC_CONFIG = """
name: "affine_static"
platform: "ge"
parameters { key: "model_path" value { string_value: "compiled/affine_bs4.om" } }
instance_group [ { kind: KIND_GPU count: 1 gpus: [ 1 ] } ]
"""

# An ensemble of `.om` models: affine_gears applied twice, y2 = 2 * (2x + 1) + 1.
PIPELINE_CONFIG = config_text(
    "affine_twice",
    platform="ensemble",
    max_batch_size=8,
    inputs=[("X", "TYPE_FP32", "4")],
    outputs=[("Y", "TYPE_FP32", "4"), ("S", "TYPE_FP32", "1")],
    extra="""ensemble_scheduling {
  step [
    { model_name: "affine_gears" model_version: -1 input_map { key: "x" value: "X" }
      output_map [ { key: "y" value: "once" }, { key: "s" value: "S" } ] },
    { model_name: "affine_gears" model_version: -1 input_map { key: "x" value: "once" }
      output_map { key: "y" value: "Y" } }
  ]
}""",
)


def _repository(root: Path) -> Path:
    repository = root / "models"
    write_affine_om(repository / "affine_auto" / "1" / "model.om", gears=GEARS)  # no config.pbtxt at all
    write_affine_om(repository / "affine_gears" / "1" / "model.om", gears=GEARS)
    (repository / "affine_gears" / "config.pbtxt").write_text(GEARS_CONFIG)
    write_affine_om(repository / "affine_static" / "compiled" / "affine_bs4.om", static_batch=4)
    (repository / "affine_static" / "1").mkdir(parents=True)
    (repository / "affine_static" / "config.pbtxt").write_text(STATIC_CONFIG)
    copy_model("simple", repository)
    (repository / "affine_twice" / "1").mkdir(parents=True)
    (repository / "affine_twice" / "config.pbtxt").write_text(PIPELINE_CONFIG)
    return repository


def _simulator_env(root: Path) -> dict[str, str]:
    reports = root / "reports"
    reports.mkdir(exist_ok=True)
    return {
        "PYTHONPATH": os.pathsep.join([str(FAKES), os.environ.get("PYTHONPATH", "")]),
        "ACL_SIM_DEVICE_COUNT": "2",
        "ACL_SIM_REPORT_DIR": str(reports),
        "ACL_SIM_FAULT_FILE": str(root / "inject-fault"),
    }


def start_on_simulated_npus(root: Path, repository: Path, *flags: str) -> GeserveProcess:
    """A live server of `repository` on the simulator's two devices, its log and the simulator's files in `root`."""
    return GeserveProcess(
        root / "geserve.log",
        f"--model-repository={repository}",
        "--device-ids=0,1",
        *flags,
        env=_simulator_env(root),
    ).wait_live()


@pytest.fixture(scope="module")
def npu_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GeserveProcess]:
    root = tmp_path_factory.mktemp("ascend")
    process = start_on_simulated_npus(root, _repository(root), "--metrics-interval-ms=200")
    yield process
    assert process.stop() == 0, process.log()


def _rows(count: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(count, FEATURES)).astype(np.float32)


def _http_infer(client: httpclient.InferenceServerClient, model: str, x: np.ndarray) -> dict[str, np.ndarray]:
    tensor = httpclient.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=True)
    result = client.infer(model, [tensor])
    return {name: result.as_numpy(name) for name in ("y", "s")}


def _assert_matches(outputs: dict[str, np.ndarray], x: np.ndarray) -> None:
    reference = affine_reference(x)
    for name in ("y", "s"):
        np.testing.assert_array_equal(outputs[name], reference[name])


def test_config_is_completed_from_the_om(npu_server: GeserveProcess) -> None:
    client = httpclient.InferenceServerClient(npu_server.url)
    config = client.get_model_config("affine_auto")
    assert config["backend"] == "ge"
    assert config["max_batch_size"] == 8
    assert config["dynamic_batching"]["preferred_batch_size"] == GEARS
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == [("x", "TYPE_FP32", [4])]
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["output"]] == [
        ("y", "TYPE_FP32", [4]),
        ("s", "TYPE_FP32", [1]),
    ]
    metadata = client.get_model_metadata("affine_auto")
    assert metadata["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
    static = client.get_model_config("affine_static")
    assert static["max_batch_size"] == 4
    assert static["dynamic_batching"]["preferred_batch_size"] == [4]


def test_every_gear_and_every_size_between_over_http_and_grpc(npu_server: GeserveProcess) -> None:
    http = httpclient.InferenceServerClient(npu_server.url)
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{npu_server.grpc_port}")
    for rows in range(1, 9):
        x = _rows(rows, seed=rows)
        _assert_matches(_http_infer(http, "affine_gears", x), x)
        tensor = grpcclient.InferInput("x", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        result = grpc.infer("affine_auto", [tensor])
        _assert_matches({name: result.as_numpy(name) for name in ("y", "s")}, x)


def test_static_batch_model_pads_to_its_batch_and_refuses_more(npu_server: GeserveProcess) -> None:
    client = httpclient.InferenceServerClient(npu_server.url)
    for rows in (1, 2, 3, 4):
        x = _rows(rows, seed=10 + rows)
        _assert_matches(_http_infer(client, "affine_static", x), x)
    with pytest.raises(InferenceServerException) as error:
        _http_infer(client, "affine_static", _rows(5))
    assert error.value.status() == "400"
    assert "batch-size must be <= 4" in error.value.message()
    x = _rows(2, seed=99)
    _assert_matches(_http_infer(client, "affine_static", x), x)


def test_concurrent_requests_are_batched_and_counted_by_real_rows(npu_server: GeserveProcess) -> None:
    http = httpclient.InferenceServerClient(npu_server.url)

    def counts() -> tuple[int, int, int]:
        stats = http.get_inference_statistics("affine_gears")["model_stats"][0]
        return stats["inference_count"], stats["execution_count"], stats["inference_stats"]["success"]["count"]

    before = counts()
    sizes = [1 + (index % 3) for index in range(48)]
    inputs = [_rows(rows, seed=100 + index) for index, rows in enumerate(sizes)]

    async def run() -> list[dict[str, np.ndarray]]:
        client = grpcclient_aio.InferenceServerClient(f"127.0.0.1:{npu_server.grpc_port}")
        try:

            async def one(x: np.ndarray) -> dict[str, np.ndarray]:
                tensor = grpcclient_aio.InferInput("x", list(x.shape), "FP32")
                tensor.set_data_from_numpy(x)
                result = await client.infer("affine_gears", [tensor])
                return {name: result.as_numpy(name) for name in ("y", "s")}

            return await asyncio.gather(*(one(x) for x in inputs))
        finally:
            await client.close()

    for x, outputs in zip(inputs, asyncio.run(run()), strict=True):
        _assert_matches(outputs, x)  # each response answers its own request
    after = counts()
    assert after[0] - before[0] == sum(sizes)  # rows the clients sent, not the padded gears
    assert after[2] - before[2] == len(sizes)
    assert after[1] - before[1] < len(sizes)  # batched


def _scrape(server: GeserveProcess) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as response:
        return str(response.read().decode())


def test_npu_usage_is_exported_under_triton_gpu_names(npu_server: GeserveProcess) -> None:
    deadline = time.monotonic() + 30
    text = _scrape(npu_server)
    while 'gpu_uuid="NPU-1"' not in text and time.monotonic() < deadline:
        time.sleep(0.2)
        text = _scrape(npu_server)
    for device in (0, 1):
        total = re.search(rf'\nnv_gpu_memory_total_bytes\{{gpu_uuid="NPU-{device}"\}} (\d+)', text)
        used = re.search(rf'\nnv_gpu_memory_used_bytes\{{gpu_uuid="NPU-{device}"\}} (\d+)', text)
        assert total is not None and int(total.group(1)) == 8 << 30
        assert used is not None and 0 < int(used.group(1)) < 8 << 30
        assert re.search(rf'\nnv_gpu_utilization\{{gpu_uuid="NPU-{device}"\}} [0-9.e-]+', text)
    # per-model series are unchanged: no gpu_uuid label on them
    assert re.search(r'\nnv_inference_count\{model="affine_gears",version="1"\} \d+', text)


def test_device_fault_fails_the_batch_and_the_instance_comes_back(npu_server: GeserveProcess) -> None:
    client = httpclient.InferenceServerClient(npu_server.url)
    fault_file = npu_server.log_path.parent / "inject-fault"  # ACL_SIM_FAULT_FILE
    x = _rows(3, seed=7)
    fault_file.write_text("507011")
    with pytest.raises(InferenceServerException) as error:
        _http_infer(client, "affine_static", x)  # one instance, on device 1
    assert error.value.status() == "500"
    assert "507011 (ACL_ERROR_RT_MODEL_EXECUTE)" in error.value.message()
    assert "injected fault 507011" in error.value.message()
    # the other models keep serving while the instance restarts
    _assert_matches(_http_infer(client, "affine_gears", x), x)
    deadline = time.monotonic() + 60
    while True:
        try:
            outputs = _http_infer(client, "affine_static", x)
            break
        except InferenceServerException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    _assert_matches(outputs, x)
    assert "exited after a device failure" in npu_server.log()


def test_leak_check_is_clean_after_unload_on_both_devices(launch: Launch, tmp_path: Path) -> None:
    repository = tmp_path / "models"
    write_affine_om(repository / "affine_gears" / "1" / "model.om", gears=GEARS)
    (repository / "affine_gears" / "config.pbtxt").write_text(GEARS_CONFIG)
    env = _simulator_env(tmp_path)
    server = launch(f"--model-repository={repository}", "--device-ids=0,1", "--metrics-interval-ms=100", env=env)
    server.wait_live()
    inputs = [_rows(1 + index % 8, seed=index) for index in range(40)]

    async def run() -> None:
        client = grpcclient_aio.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        try:

            async def one(x: np.ndarray) -> None:
                tensor = grpcclient_aio.InferInput("x", list(x.shape), "FP32")
                tensor.set_data_from_numpy(x)
                result = await client.infer("affine_gears", [tensor])
                _assert_matches({name: result.as_numpy(name) for name in ("y", "s")}, x)

            await asyncio.gather(*(one(x) for x in inputs))
        finally:
            await client.close()

    asyncio.run(run())
    http = httpclient.InferenceServerClient(server.url)
    for rows in range(1, 9):  # every size, so every padding path runs
        x = _rows(rows, seed=1000 + rows)
        _assert_matches(_http_infer(http, "affine_gears", x), x)
    time.sleep(0.3)  # a device-usage poll
    assert server.stop() == 0
    reports = [json.loads(path.read_text()) for path in (tmp_path / "reports").glob("acl-sim-*.json")]
    assert sorted(report["visible_devices"] for report in reports) == ["0", "1"]
    for report in reports:
        assert report["finalized"], report
        assert report["leaks"] == [], report
        assert report["executions"] > 0, report  # both devices served
        assert set(report["rows_executed"]) <= set(GEARS)
    called = set().union(*(report["calls"] for report in reports))
    assert called >= BACKEND_CALLS, sorted(BACKEND_CALLS - called)


def test_without_pyacl_the_model_fails_to_load_and_the_rest_serve(launch: Launch, tmp_path: Path) -> None:
    repository = tmp_path / "models"
    write_affine_om(repository / "affine_gears" / "1" / "model.om", gears=GEARS)
    (repository / "affine_gears" / "config.pbtxt").write_text(GEARS_CONFIG)
    copy_model("simple", repository)
    server = launch(f"--model-repository={repository}", "--device-ids=0,1", "--exit-on-error=false").wait_live()
    client = httpclient.InferenceServerClient(server.url)
    assert not client.is_model_ready("affine_gears")
    assert client.is_model_ready("simple")
    log = server.log()
    assert "comes with the Ascend CANN toolkit" in log and "set_env.sh" in log
    left = np.ones((1, 16), dtype=np.int32)
    inputs = [httpclient.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
    for tensor in inputs:
        tensor.set_data_from_numpy(left)
    np.testing.assert_array_equal(client.infer("simple", inputs).as_numpy("OUTPUT0"), left * 2)
    assert server.stop() == 0


def test_config_contradicting_the_om_fails_startup_naming_both(launch: Launch, tmp_path: Path) -> None:
    repository = tmp_path / "models"
    write_affine_om(repository / "affine_gears" / "1" / "model.om", gears=GEARS)
    (repository / "affine_gears" / "config.pbtxt").write_text(
        GEARS_CONFIG.replace("max_batch_size: 8", "max_batch_size: 16")
    )  # on the two NPUs the runtime counts (no --device-ids)
    server = launch(f"--model-repository={repository}", env=_simulator_env(tmp_path))
    assert server.wait_exit() != 0
    log = server.log()
    assert "config max_batch_size 16 exceeds what" in log
    assert "its largest batch gear is 8 (gears [1, 2, 4, 8])" in log
    assert "affine_gears/1/model.om" in log
    server.stop()


def test_an_ensemble_of_om_models_runs_each_step_on_the_npu(npu_server: GeserveProcess) -> None:
    client = httpclient.InferenceServerClient(npu_server.url)
    x = _rows(3, seed=9)
    tensor = httpclient.InferInput("X", [3, FEATURES], "FP32")
    tensor.set_data_from_numpy(x)
    result = client.infer("affine_twice", [tensor])
    once = affine_reference(x)
    np.testing.assert_array_equal(result.as_numpy("S"), once["s"])
    np.testing.assert_array_equal(result.as_numpy("Y"), affine_reference(once["y"])["y"])


def test_the_next_batch_is_copied_in_while_the_device_runs_one(launch: Launch, tmp_path: Path) -> None:
    """A .om worker takes two batches at once: while the device runs one (100 ms here), the next is copied
    to the device's other input side, and every request still gets its own rows back."""
    repository = tmp_path / "models"
    write_affine_om(repository / "affine_gears" / "1" / "model.om", gears=GEARS)
    config = GEARS_CONFIG.replace("gpus: [ 0, 1 ]", "gpus: [ 0 ]")
    (repository / "affine_gears" / "config.pbtxt").write_text(config)
    env = {**_simulator_env(tmp_path), "ACL_SIM_EXECUTE_US": "100000"}
    server = launch(f"--model-repository={repository}", "--device-ids=0", env=env).wait_live()
    inputs = [_rows(8, seed=index) for index in range(6)]  # six full batches

    with ThreadPoolExecutor(len(inputs)) as pool:
        clients = [httpclient.InferenceServerClient(server.url) for _ in inputs]
        pairs = list(zip(clients, inputs, strict=True))
        results = list(pool.map(lambda pair: _http_infer(pair[0], "affine_gears", pair[1]), pairs))
    for outputs, x in zip(results, inputs, strict=True):
        _assert_matches(outputs, x)
    assert server.stop() == 0
    (report,) = [json.loads(path.read_text()) for path in (tmp_path / "reports").glob("acl-sim-*.json")]
    assert report["leaks"] == [], report
    assert report["calls"]["mdl.create_dataset"] == 3, report["calls"]  # the second input side was used
    assert report["calls"]["mdl.execute_async"] == 6
