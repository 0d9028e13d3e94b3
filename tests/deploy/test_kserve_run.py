"""geserve started exactly as the KServe ServingRuntime says, probed and driven as kubelet and the agent do."""

from __future__ import annotations

import shutil
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.deploy.manifests import by_kind, containers_of, kserve_objects
from tests.support import (
    GeserveProcess,
    config_text,
    copy_model,
    free_ports,
    write_identity_model,
    write_python_model,
)

pytestmark = pytest.mark.e2e

SLOW_MODEL = """
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        time.sleep(2)  # a model that takes a while to load

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.get_input_tensor_by_name(r, "IN")]) for r in requests]
"""
SLOW_CONFIG = config_text(
    "slow", backend="python", inputs=[("IN", "TYPE_INT32", "1")], outputs=[("IN", "TYPE_INT32", "1")]
)


def _status(url: str, method: str = "GET") -> int | None:
    """The HTTP status, or None when nothing answers (as kubelet sees a closed port)."""
    request = urllib.request.Request(url, method=method, data=b"{}" if method == "POST" else None)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        with error:
            return int(error.code)
    except OSError:
        return None


def _runtime_args(
    repository: Path, http_port: int, grpc_port: int, metrics_port: int, runtime_name: str = "geserve"
) -> list[str]:
    """The runtime's container args with the pod's paths and ports swapped for this machine's."""
    runtime = next(
        r for r in by_kind(kserve_objects(), "ClusterServingRuntime") if r["metadata"]["name"] == runtime_name
    )
    swaps = {
        "--model-repository=/mnt/models": f"--model-repository={repository}",
        "--http-port=8080": f"--http-port={http_port}",
        "--grpc-port=9000": f"--grpc-port={grpc_port}",
        "--metrics-port=8002": f"--metrics-port={metrics_port}",
    }
    args = [swaps.get(arg, arg) for arg in containers_of(runtime)[0]["args"]]
    assert set(swaps.values()) <= set(args), args
    return args


def test_kubelet_style_run(tmp_path: Path) -> None:
    repository = tmp_path / "mnt-models"
    copy_model("simple", repository)
    write_python_model(repository, "slow", SLOW_MODEL, SLOW_CONFIG)
    write_identity_model(repository, "sleepy", dims="1", delay_ms=2000)
    http_port, grpc_port, metrics_port = free_ports(3)
    args = _runtime_args(repository, http_port, grpc_port, metrics_port)
    server = GeserveProcess(tmp_path / "geserve.log", *args)
    # GeserveProcess adds its own ports first; the runtime's flags come later and win.
    server.http_port, server.grpc_port, server.metrics_port = http_port, grpc_port, metrics_port
    ready_url = f"http://127.0.0.1:{http_port}/v2/health/ready"
    try:
        # Readiness (kubelet's startup and readiness probes) turns true only once every model loaded.
        deadline = time.monotonic() + 90
        while _status(ready_url) != 200:
            assert server.process.poll() is None, server.log()
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.05)
        client = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}")
        assert client.is_model_ready("slow") and client.is_model_ready("simple")

        # The model agent: download into the repository, then load; later unload.
        copy_model("simple_string", repository)
        assert _status(f"http://127.0.0.1:{http_port}/v2/repository/models/simple_string/load", "POST") == 200
        assert client.is_model_ready("simple_string")
        assert _status(f"http://127.0.0.1:{http_port}/v2/repository/models/simple_string/unload", "POST") == 200
        assert not client.is_model_ready("simple_string")
        shutil.rmtree(repository / "simple_string")
        assert _status(ready_url) == 200  # an unloaded model does not make the pod unready

        # SIGTERM with a request in flight: readiness drops at once, the request still completes.
        outcome: dict[str, Any] = {}

        def slow_request() -> None:
            tensor = httpclient.InferInput("INPUT0", [1, 1], "FP32")
            tensor.set_data_from_numpy(np.array([[7.0]], dtype=np.float32))
            try:
                result = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}").infer("sleepy", [tensor])
                outcome["value"] = result.as_numpy("OUTPUT0")
            except Exception as error:
                outcome["error"] = error
            outcome["done_at"] = time.monotonic()

        request = threading.Thread(target=slow_request)
        request.start()
        time.sleep(0.5)  # the request is in the worker
        server.process.terminate()
        unready_at = None
        while request.is_alive():
            if _status(ready_url) != 200:
                unready_at = time.monotonic()
                break
            time.sleep(0.02)
        request.join(30)
        assert unready_at is not None and unready_at < outcome["done_at"], outcome
        assert "error" not in outcome, outcome
        np.testing.assert_array_equal(outcome["value"], [[7.0]])
        assert server.process.wait(60) == 0, server.log()
    finally:
        server.stop()


def test_the_multi_model_runtime_after_a_container_restart(tmp_path: Path) -> None:
    """What the model agent had placed in /mnt/models loads again; a model that cannot load leaves the rest up."""
    repository = tmp_path / "mnt-models"
    copy_model("simple", repository)
    write_identity_model(repository, "broken", delay_ms="x")  # not a number: its load fails
    http_port, grpc_port, metrics_port = free_ports(3)
    args = _runtime_args(repository, http_port, grpc_port, metrics_port, runtime_name="geserve-mms")
    server = GeserveProcess(tmp_path / "geserve.log", *args)
    server.http_port, server.grpc_port, server.metrics_port = http_port, grpc_port, metrics_port
    try:
        server.wait_live()
        client = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}")
        deadline = time.monotonic() + 60
        while not client.is_model_ready("simple"):
            assert server.process.poll() is None and time.monotonic() < deadline, server.log()
            time.sleep(0.1)
        assert not client.is_model_ready("broken")
        assert server.process.poll() is None  # --exit-on-error=false: still serving
        index = {entry["name"]: entry for entry in client.get_model_repository_index()}
        assert index["simple"]["state"] == "READY" and index["broken"]["state"] == "UNAVAILABLE"
    finally:
        assert server.stop() == 0, server.log()
