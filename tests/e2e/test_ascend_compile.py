"""A Triton ONNX repository switched to `backend: "ge"`: compiled with ATC at load (a stand-in `atc` on PATH,
the pyACL simulator for the NPUs), cached across restarts, compiled offline by `geserve compile`, and served
with ONNX Runtime where there is no NPU."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto, helper

from tests.e2e.test_ascend import Launch, _simulator_env
from tests.fakes import atc as fake_atc
from tests.fakes.om_models import FEATURES, affine_onnx, affine_reference, write_affine_om
from tests.support import ROOT, GeserveProcess, write_identity_model

pytestmark = [pytest.mark.e2e, pytest.mark.one_layout]

# The config a Triton user has for the ONNX model, with `backend: "onnxruntime"` changed to "ge".
CONFIG = """
name: "{name}"
backend: "ge"
max_batch_size: 8
input [ {{ name: "x" data_type: TYPE_FP32 dims: [ {features} ] }} ]
output [
  {{ name: "y" data_type: TYPE_FP32 dims: [ {features} ] }},
  {{ name: "s" data_type: TYPE_FP32 dims: [ 1 ] }}
]
dynamic_batching {{ preferred_batch_size: [ 4 ] }}
instance_group [ {{ kind: KIND_AUTO count: 1 }} ]
parameters {{ key: "atc_option.output_type" value {{ string_value: "FP32" }} }}
"""
CANN_VERSION = "8.0.RC1"


def _unsupported_onnx() -> bytes:
    """A graph with an op ATC has no kernel for, so its compile fails."""
    graph = helper.make_graph(
        [helper.make_node("Frobnicate", ["x"], ["y"], domain="example.custom")],
        "broken",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", FEATURES])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", FEATURES])],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("example.custom", 1)]
    )
    return model.SerializeToString()


def _onnx_model(repository: Path, name: str, data: bytes, om: bool = False) -> Path:
    folder = repository / name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "1" / "model.onnx").write_bytes(data)
    (folder / "config.pbtxt").write_text(
        CONFIG.format(name=name, features=FEATURES).replace('"y" data_type', '"y" data_type')
    )
    if om:
        write_affine_om(folder / "1" / "model.om", gears=[1, 4, 8])
    return folder


class Host:
    """A test host: its repository, its ATC (on PATH, logging each run), its CANN folder and its cache."""

    def __init__(self, root: Path, simulator: bool = True, atc: bool = True) -> None:
        self.root = root
        self.repository = root / "models"
        self.repository.mkdir(parents=True, exist_ok=True)
        self.cache = root / "cache"
        self.atc_log = root / "atc-runs.jsonl"
        self.env: dict[str, str] = _simulator_env(root) if simulator else {}
        path = os.environ.get("PATH", "")
        if atc:
            path = f"{fake_atc.install(root / 'bin').parent}{os.pathsep}{path}"
        cann = fake_atc.install_cann(root / "cann", CANN_VERSION)
        self.env.update({"PATH": path, "ASCEND_HOME_PATH": str(cann), "FAKE_ATC_LOG": str(self.atc_log)})

    def runs(self, model: str) -> list[list[str]]:
        """The ATC command lines run for `model` so far."""
        lines = self.runs_all()
        return [argv for argv in lines if f"--model={self.repository / model / '1' / 'model.onnx'}" in argv]

    def runs_all(self) -> list[list[str]]:
        """Every ATC command line run so far."""
        if not self.atc_log.is_file():
            return []
        return [json.loads(line) for line in self.atc_log.read_text().splitlines()]

    def npu_executions(self) -> tuple[int, set[int]]:
        """Batches the simulated NPUs ran so far, and the gears they ran at."""
        reports = [json.loads(path.read_text()) for path in (self.root / "reports").glob("acl-sim-*.json")]
        rows: set[int] = set().union(*(report["rows_executed"] for report in reports))
        return sum(report["executions"] for report in reports), rows

    def start(self, launch: Launch, *flags: str) -> GeserveProcess:
        return launch(
            f"--model-repository={self.repository}", f"--model-cache-dir={self.cache}", "--exit-on-error=false",
            *flags, env=self.env,
        ).wait_live(timeout_s=180)  # fmt: skip


def _rows(count: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(count, FEATURES)).astype(np.float32)


def _assert_serves(server: GeserveProcess, model: str) -> None:
    """HTTP and gRPC answers equal ONNX Runtime's, for one row and for a batch between gears."""
    http = httpclient.InferenceServerClient(server.url)
    for rows in (1, 3):
        x = _rows(rows, seed=rows)
        tensor = httpclient.InferInput("x", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        result = http.infer(model, [tensor])
        reference = affine_reference(x)
        for name in ("y", "s"):
            np.testing.assert_allclose(result.as_numpy(name), reference[name], rtol=1e-6)
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    x = _rows(5, seed=9)
    tensor = grpcclient.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    np.testing.assert_allclose(grpc.infer(model, [tensor]).as_numpy("y"), affine_reference(x)["y"], rtol=1e-6)
    grpc.close()


def test_compiled_at_load_cached_across_restarts_and_recompiled_when_the_onnx_changes(
    launch: Launch, tmp_path: Path
) -> None:
    host = Host(tmp_path)
    _onnx_model(host.repository, "affine", affine_onnx())
    _onnx_model(host.repository, "broken", _unsupported_onnx())
    server = host.start(launch, "--device-ids=0,1")
    client = httpclient.InferenceServerClient(server.url)
    assert client.is_model_ready("affine")
    [argv] = host.runs("affine")
    onnx_path = host.repository / "affine" / "1" / "model.onnx"
    assert argv[:2] == ["--framework=5", f"--model={onnx_path}"]
    assert argv[3:] == [
        "--input_shape=x:-1,4",
        "--dynamic_batch_size=1,4,8",
        "--soc_version=Ascend310P3",  # the simulated host's chip, asked of pyACL
        "--output_type=FP32",
        f"--op_compiler_cache_dir={host.cache / '.atc_op_cache'}",  # ATC's operator cache: not $HOME/atc_data
    ]
    log = server.log()
    assert (
        f"compiling '{onnx_path}' with ATC: " in log and "--dynamic_batch_size=1,4,8 --soc_version=Ascend310P3" in log
    )
    config = client.get_model_config("affine")
    assert config["backend"] == "ge" and config["max_batch_size"] == 8 and "npu_fallback" not in config["parameters"]
    assert client.get_model_metadata("affine")["platform"] == "ge"
    _assert_serves(server, "affine")
    # A compile that fails is the model's load error, with ATC's own words; the other model serves on.
    assert not client.is_model_ready("broken")
    [entry] = [m for m in client.get_model_repository_index() if m["name"] == "broken"]
    assert "ATC failed (exit 1)" in entry["reason"] and "E11001" in entry["reason"] and "Frobnicate" in entry["reason"]
    assert server.stop() == 0
    executions, rows = host.npu_executions()
    assert executions > 0 and rows <= {1, 4, 8}, rows  # the simulated NPU ran the compiled gears
    entries = sorted(path.name for path in host.cache.iterdir())
    assert len(entries) == 1 and entries[0].startswith("affine-")  # nothing half-written left behind

    # A restart finds the compiled model in the cache: ATC does not run again for it.
    server = host.start(launch, "--device-ids=0,1")
    assert httpclient.InferenceServerClient(server.url).is_model_ready("affine")
    assert len(host.runs("affine")) == 1
    assert "using the cached compile" in server.log()
    _assert_serves(server, "affine")
    assert server.stop() == 0

    # A changed ONNX file is a new cache key: compiled again.
    changed = onnx.load_from_string(affine_onnx())
    changed.doc_string = "re-exported"
    onnx_path.write_bytes(changed.SerializeToString())
    server = host.start(launch, "--device-ids=0,1")
    assert httpclient.InferenceServerClient(server.url).is_model_ready("affine")
    assert len(host.runs("affine")) == 2
    _assert_serves(server, "affine")
    assert server.stop() == 0


def _compile(host: Host, *flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "geserve", "compile", f"--model-repository={host.repository}",
         f"--model-cache-dir={host.cache}", *flags],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, **host.env, **(env or {})}, timeout=300, check=False,
    )  # fmt: skip


def test_geserve_compile_fills_the_cache_offline_and_the_server_uses_it(launch: Launch, tmp_path: Path) -> None:
    host = Host(tmp_path)
    _onnx_model(host.repository, "affine", affine_onnx())
    _onnx_model(host.repository, "broken", _unsupported_onnx())
    _onnx_model(host.repository, "shipped", affine_onnx(), om=True)
    bare = _onnx_model(host.repository, "bare", affine_onnx())
    (bare / "config.pbtxt").write_text('name: "bare" backend: "ge" max_batch_size: 8')  # inputs from model.onnx
    (host.repository / "plain" / "1").mkdir(parents=True)
    (host.repository / "plain" / "config.pbtxt").write_text('name: "plain" backend: "identity"')
    done = _compile(host)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert any(line.startswith("affine version 1: compiled: ") for line in lines), lines
    assert any(line.startswith("bare version 1: compiled: ") for line in lines), lines
    assert "--input_shape=x:-1,4 --dynamic_batch_size=1,8" in " ".join(" ".join(argv) for argv in host.runs("bare"))
    assert any(line.startswith("broken version 1: failed: ") and "E11001" in done.stdout for line in lines), lines
    assert "shipped version 1: skipped: it has an .om already" in lines
    assert "plain: skipped: backend 'identity' is not compiled" in lines
    # A build machine without an NPU names the chip; the same key, so the entry is found.
    shutil.rmtree(host.repository / "broken")
    done = _compile(host, "--soc-version=Ascend310P3", env={"PYTHONPATH": ""})
    assert done.returncode == 0, done.stdout + done.stderr
    assert any(line.startswith("affine version 1: cached: ") for line in done.stdout.splitlines()), done.stdout
    assert len(host.runs("affine")) == 1
    server = host.start(launch, "--device-ids=0,1")
    assert httpclient.InferenceServerClient(server.url).is_model_ready("affine")
    assert len(host.runs("affine")) == 1 and len(host.runs("bare")) == 1
    _assert_serves(server, "affine")
    _assert_serves(server, "bare")  # its config completed from the compiled .om
    assert server.stop() == 0


def test_without_npus_onnx_runtime_serves_and_says_so(launch: Launch, tmp_path: Path) -> None:
    host = Host(tmp_path, simulator=False, atc=False)
    _onnx_model(host.repository, "affine", affine_onnx())
    _onnx_model(host.repository, "both", affine_onnx(), om=True)
    om_only = host.repository / "om_only"
    write_affine_om(om_only / "1" / "model.om", gears=[1, 4, 8])
    (om_only / "config.pbtxt").write_text('name: "om_only" backend: "ge"')
    server = host.start(launch)
    client = httpclient.InferenceServerClient(server.url)
    log = server.log()
    for model in ("affine", "both"):
        assert client.is_model_ready(model)
        config = client.get_model_config(model)
        assert (config["backend"], config["platform"]) == ("onnxruntime", "onnxruntime_onnx")
        assert client.get_model_metadata(model)["platform"] == "onnxruntime_onnx"
        assert config["parameters"]["npu_fallback"]["string_value"].startswith(
            "served with ONNX Runtime: this host has no NPU"
        )
        assert f"model '{model}' version 1: backend 'ge' served with ONNX Runtime from model.onnx" in log
        _assert_serves(server, model)
    # Every fallback is visible where operators look: the repository index and a gauge per version.
    index = {entry["name"]: entry for entry in client.get_model_repository_index()}
    for model in ("affine", "both"):
        assert index[model]["state"] == "READY"
        assert index[model]["reason"].startswith("served with ONNX Runtime: this host has no NPU"), index
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as response:
        metrics = response.read().decode()
    assert 'geserve_npu_fallback{model="affine",version="1"} 1' in metrics, metrics
    assert 'geserve_npu_fallback{model="both",version="1"} 1' in metrics, metrics
    assert not client.is_model_ready("om_only")  # nothing to fall back to: today's load error
    refusal = [line for line in log.splitlines() if "failed to load 'om_only'" in line]
    assert refusal and "no NPUs" in refusal[0] and "model.onnx" in refusal[0] and "set_env.sh" in refusal[0], log
    assert not host.runs("affine")
    assert server.stop() == 0


def test_npu_off_uses_onnx_runtime_beside_npus_and_required_fails_without_them(launch: Launch, tmp_path: Path) -> None:
    host = Host(tmp_path)
    _onnx_model(host.repository, "both", affine_onnx(), om=True)
    _onnx_model(host.repository, "affine", affine_onnx())
    server = host.start(launch, "--device-ids=0,1", "--npu=off")
    client = httpclient.InferenceServerClient(server.url)
    for model in ("both", "affine"):
        config = client.get_model_config(model)
        assert config["backend"] == "onnxruntime"
        assert config["parameters"]["npu_fallback"]["string_value"] == "served with ONNX Runtime: --npu=off"
        _assert_serves(server, model)
    assert not host.runs("affine")
    assert server.stop() == 0
    assert host.npu_executions()[0] == 0

    bare = Host(tmp_path / "bare", simulator=False)
    _onnx_model(bare.repository, "affine", affine_onnx())
    server = bare.start(launch, "--npu=required")
    client = httpclient.InferenceServerClient(server.url)
    assert not client.is_model_ready("affine")
    [entry] = client.get_model_repository_index()
    assert "--npu=required, but this host has no NPU" in entry["reason"]
    assert server.stop() == 0


def test_the_server_answers_while_atc_compiles(launch: Launch, tmp_path: Path) -> None:
    host = Host(tmp_path)
    host.env["FAKE_ATC_DELAY_S"] = "3"
    _onnx_model(host.repository, "affine", affine_onnx())
    write_identity_model(host.repository, "echo")
    server = host.start(launch, "--device-ids=0,1", "--model-control-mode=explicit", "--load-model=echo")
    client = httpclient.InferenceServerClient(server.url)
    with ThreadPoolExecutor(1) as pool:
        loading = pool.submit(httpclient.InferenceServerClient(server.url, network_timeout=120).load_model, "affine")
        answered = 0
        while not loading.done():
            x = np.ones((1, 4), dtype=np.float32)
            tensor = httpclient.InferInput("INPUT0", [1, 4], "FP32")
            tensor.set_data_from_numpy(x)
            np.testing.assert_array_equal(client.infer("echo", [tensor]).as_numpy("OUTPUT0"), x)
            answered += 1
            time.sleep(0.05)
        loading.result()
    assert answered >= 10, answered  # ATC took 3 s; requests kept being answered meanwhile
    assert len(host.runs("affine")) == 1
    _assert_serves(server, "affine")
    assert server.stop() == 0


def _wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_compiles_run_on_their_own_threads_so_requests_needing_a_thread_are_answered(
    launch: Launch, tmp_path: Path
) -> None:
    host = Host(tmp_path)
    gate = tmp_path / "release-atc"
    host.env["FAKE_ATC_GATE"] = str(gate)  # every ATC run waits until the test releases it
    # More compiles than asyncio's default pool has threads (min(32, cores + 4)), which gzip bodies also use.
    count = min(32, (os.cpu_count() or 1) + 4) + 1
    names = [f"affine{index}" for index in range(count)]
    for name in names:
        _onnx_model(host.repository, name, affine_onnx())
    write_identity_model(host.repository, "echo")
    server = host.start(launch, "--device-ids=0,1", "--model-control-mode=explicit", "--load-model=echo")
    with ThreadPoolExecutor(count) as pool:
        loads = [
            pool.submit(httpclient.InferenceServerClient(server.url, network_timeout=300).load_model, name)
            for name in names
        ]
        try:
            # One ATC runs (--model-compile-concurrency 1) and every other load waits its turn.
            _wait_for(lambda: len(host.runs_all()) >= 1, "an ATC running")
            # Every other load queued (said in the log); a bounded wait so that a server without the queue (every
            # compile on the shared pool) gets as far as the gzip request, which it cannot answer.
            with contextlib.suppress(AssertionError):
                _wait_for(lambda: server.log().count("waits to compile") == count - 1, "loads queued", timeout_s=30)
            x = np.random.default_rng(0).normal(size=(1, 1 << 16)).astype(np.float32)  # 256 KiB: decoded on a thread
            tensor = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x)
            client = httpclient.InferenceServerClient(server.url, network_timeout=30)
            answer = client.infer("echo", [tensor], request_compression_algorithm="gzip")
            np.testing.assert_array_equal(answer.as_numpy("OUTPUT0"), x)
            done = [str(load.exception()) for load in loads if load.done()]
            assert not done, (done, server.log())  # answered while every compile still waits on ATC
            assert len(host.runs_all()) == 1
        finally:
            gate.touch()
        for load in loads:
            load.result()
    assert all(len(host.runs(name)) == 1 for name in names)
    assert server.stop() == 0


def test_sigterm_during_a_compile_kills_atc_and_exits_promptly(launch: Launch, tmp_path: Path) -> None:
    host = Host(tmp_path)
    pids = tmp_path / "atc-pids"
    pids.mkdir()
    host.env.update({"FAKE_ATC_GATE": str(tmp_path / "never"), "FAKE_ATC_PID_DIR": str(pids)})  # ATC never ends
    _onnx_model(host.repository, "affine", affine_onnx())
    write_identity_model(host.repository, "echo")
    server = host.start(launch, "--device-ids=0,1", "--model-control-mode=explicit", "--load-model=echo")
    with ThreadPoolExecutor(1) as pool:
        loading = pool.submit(httpclient.InferenceServerClient(server.url, network_timeout=300).load_model, "affine")
        _wait_for(lambda: any(pids.iterdir()), "ATC started")
        [pid_file] = list(pids.iterdir())
        atc_pid = int(pid_file.read_text())
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        assert server.wait_exit(timeout_s=30) == 0
        assert time.monotonic() - started < 30
        with pytest.raises(Exception):  # noqa: B017 the load fails with the compile, or with the server gone
            loading.result()
    _wait_for(lambda: not Path(f"/proc/{atc_pid}").exists(), "ATC killed", timeout_s=10)
    log = server.log()
    assert "Traceback" not in log and "CancelledError" not in log, log
    assert "compile cancelled" in log, log
