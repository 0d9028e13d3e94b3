"""Triton's address syntax `ipv6:[::1]` for --http-address and --grpc-address: served there, through tritonclient."""

from __future__ import annotations

import socket
import time
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.support import GeserveProcess, http_status, write_identity_model

pytestmark = pytest.mark.e2e


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GeserveProcess]:
    if not _has_ipv6_loopback():
        pytest.skip("this machine has no IPv6 loopback (::1)")
    root = tmp_path_factory.mktemp("ipv6")
    write_identity_model(root / "models", "echo")
    process = GeserveProcess(
        root / "geserve.log",
        f"--model-repository={root / 'models'}",
        "--http-address=ipv6:[::1]",
        "--grpc-address=ipv6:[::1]",
    )
    deadline = time.monotonic() + 90
    while True:
        assert process.process.poll() is None, process.log()
        try:
            if http_status(f"http://[::1]:{process.http_port}/v2/health/ready") == 200:
                break
        except OSError:
            pass
        assert time.monotonic() < deadline, process.log()
        time.sleep(0.1)
    yield process
    assert process.stop() == 0, process.log()


def test_http_and_grpc_answer_on_the_ipv6_loopback(server: GeserveProcess) -> None:
    values = np.array([1.5, -2.0, 3.25], dtype=np.float32)
    http = httpclient.InferenceServerClient(f"[::1]:{server.http_port}")
    tensor = httpclient.InferInput("INPUT0", [1, 3], "FP32")
    tensor.set_data_from_numpy(values.reshape(1, 3))
    np.testing.assert_array_equal(http.infer("echo", [tensor]).as_numpy("OUTPUT0"), values.reshape(1, 3))
    http.close()
    grpc = grpcclient.InferenceServerClient(f"ipv6:[::1]:{server.grpc_port}")
    tensor = grpcclient.InferInput("INPUT0", [1, 3], "FP32")
    tensor.set_data_from_numpy(2 * values.reshape(1, 3))
    np.testing.assert_array_equal(grpc.infer("echo", [tensor]).as_numpy("OUTPUT0"), 2 * values.reshape(1, 3))
    grpc.close()
    # Metrics follow the HTTP address, as in Triton.
    with urllib.request.urlopen(f"http://[::1]:{server.metrics_port}/metrics", timeout=10) as response:
        assert b'nv_inference_request_success{model="echo",version="1"} 2' in response.read()


def test_the_ipv4_loopback_is_not_served(server: GeserveProcess) -> None:
    for port in (server.http_port, server.grpc_port):
        with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
