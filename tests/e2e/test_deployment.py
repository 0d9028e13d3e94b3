"""Deployment behaviour of a live server: drain on SIGTERM, ports not shared by accident, Triton's command line."""

from __future__ import annotations

import collections
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.conftest import geserve_segments
from tests.support import (
    ROOT,
    SUITE_SERVERS,
    EchoLoad,
    GeserveProcess,
    free_ports,
    http_status,
    with_server_mode,
    write_identity_model,
)

pytestmark = pytest.mark.e2e

Launch = Callable[..., GeserveProcess]


def _body(values: list[float]) -> bytes:
    return json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "FP32", "data": values}]}).encode()


def test_sigterm_drains_a_steady_load_with_no_failed_request(launch: Launch, repository: Path) -> None:
    write_identity_model(repository, "echo")
    drain_s = 3
    server = launch(f"--model-repository={repository}", f"--drain-delay-secs={drain_s}").wait_live()
    grpc_outcomes: collections.Counter[str] = collections.Counter()
    grpc_stop = threading.Event()

    def grpc_load() -> None:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        sent = 0
        while not grpc_stop.is_set():
            data = np.array([[float(sent), 1.0]], dtype=np.float32)
            sent += 1
            tensor = grpcclient.InferInput("INPUT0", [1, 2], "FP32")
            tensor.set_data_from_numpy(data)
            try:
                same = np.array_equal(client.infer("echo", [tensor]).as_numpy("OUTPUT0"), data)
                grpc_outcomes["ok" if same else "wrong"] += 1
            except Exception as error:  # counted, and the assertion below shows it
                grpc_outcomes[str(error)[:120]] += 1
        client.close()

    grpc_thread = threading.Thread(target=grpc_load)
    with EchoLoad(server, threads=4, pause_s=0.005) as load:
        grpc_thread.start()
        time.sleep(1.0)
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        ready_while_draining = http_status(f"http://{server.url}/v2/health/ready")
        time.sleep(drain_s - 1.0)  # traffic keeps arriving for most of the window, as while endpoints propagate
        grpc_stop.set()
        grpc_thread.join()
    server.process.wait(60)
    took_s = time.monotonic() - started
    status = server.stop()  # exited already: collects the status and closes the log
    print(f"\ndrain: HTTP {dict(load.outcomes)}, gRPC {dict(grpc_outcomes)}; exit {status} after {took_s:.2f} s")
    assert ready_while_draining != 200  # out of rotation at once ...
    assert set(load.outcomes) == {"ok"}, load.outcomes  # ... yet every request during the window was served
    assert set(grpc_outcomes) == {"ok"}, grpc_outcomes
    assert status == 0
    assert drain_s <= took_s < drain_s + 10


def test_a_second_server_on_a_taken_port_exits_with_a_clear_error(launch: Launch, repository: Path) -> None:
    write_identity_model(repository, "echo")
    first = launch(f"--model-repository={repository}").wait_live()
    http_port, grpc_port, metrics_port = free_ports(3)
    for name, flags in (
        ("HTTPService", [f"--http-port={first.http_port}", f"--grpc-port={grpc_port}"]),
        ("GRPCInferenceService", [f"--http-port={http_port}", f"--grpc-port={first.grpc_port}"]),
    ):
        before = geserve_segments()
        command = [sys.executable, "-m", "geserve", f"--model-repository={repository}", "--http-address=127.0.0.1"]
        second = subprocess.run(
            [*command, *with_server_mode([*flags, f"--metrics-port={metrics_port}"])],
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        output = second.stdout + second.stderr
        assert second.returncode == 1, output
        assert f"the {name} cannot listen on" in output and "ddress already in use" in output
        assert "Traceback" not in output
        assert geserve_segments() <= before  # it exits before any worker starts
    assert http_status(f"http://{first.url}/v2/health/ready") == 200
    assert grpcclient.InferenceServerClient(f"127.0.0.1:{first.grpc_port}").is_server_ready()


def test_reuse_flags_let_two_servers_share_their_ports(launch: Launch, repository: Path) -> None:
    write_identity_model(repository, "echo")
    flags = (f"--model-repository={repository}", "--reuse-http-port=true", "--reuse-grpc-port=true")
    first = launch(*flags).wait_live()
    # The later port flags win: the second server takes the first one's HTTP and gRPC ports, its own metrics port.
    second = launch(*flags, f"--http-port={first.http_port}", f"--grpc-port={first.grpc_port}")
    second.http_port, second.grpc_port = first.http_port, first.grpc_port
    second.wait_live()  # its metrics listener is on the port only it has
    # With protocol processes its metrics listener (the engine's) may start before its HTTP and gRPC ones do.
    deadline = time.monotonic() + 30
    while not ("Started HTTPService" in second.log() and "Started GRPCInferenceService" in second.log()):
        assert time.monotonic() < deadline and second.process.poll() is None, second.log()
        time.sleep(0.1)
    assert http_status(f"http://{first.url}/v2/health/ready") == 200
    assert second.stop() == 0 and first.stop() == 0


def test_a_tritonserver_command_line_starts_geserve(launch: Launch, repository: Path, tmp_path: Path) -> None:
    write_identity_model(repository, "echo")
    http_port, grpc_port, metrics_port = free_ports(3)
    log_path = tmp_path / "tritonserver.log"
    command = [
        sys.executable,
        "-m",
        "geserve",
        "tritonserver",
        f"--model-repository={repository}",
        "--backend-directory=/opt/tritonserver/backends",
        "--allow-http=1",
        f"--http-port={http_port}",
        f"--grpc-port={grpc_port}",
        f"--metrics-port={metrics_port}",
        "--backend-config=python,shm-default-byte-size=1048576",
        "--pinned-memory-pool-byte-size=0",
    ]
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    SUITE_SERVERS.add(process.pid)  # its segments are the suite's to answer for
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, log_path.read_text()
            try:
                if http_status(f"http://127.0.0.1:{http_port}/v2/health/ready") == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
    text = log_path.read_text()
    assert "ignoring --backend-directory: geserve's backends are built in" in text
    assert "ignoring --pinned-memory-pool-byte-size" in text
    assert "ignoring --backend-config=python,shm-default-byte-size=1048576" in text
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "geserve",
            "tritonserver",
            f"--model-repository={repository}",
            "--model-namespacing=true",
        ],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert refused.returncode == 2
    assert "--model-namespacing=true is not supported" in refused.stderr


def test_grpc_channels_are_asked_to_reconnect_after_the_maximum_age(launch: Launch, repository: Path) -> None:
    write_identity_model(repository, "echo")
    server = launch(
        f"--model-repository={repository}", "--grpc-max-connection-age=300", "--grpc-max-connection-age-grace=2000"
    ).wait_live()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    states: list[grpc.ChannelConnectivity] = []
    channel.subscribe(states.append, try_to_connect=True)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    data = np.ones((1, 2), dtype=np.float32)
    probe = channel.unary_unary("/inference.GRPCInferenceService/ServerLive")
    deadline = time.monotonic() + 2.0
    calls = 0
    while time.monotonic() < deadline:
        probe(b"", timeout=5)  # an empty ServerLiveRequest
        tensor = grpcclient.InferInput("INPUT0", [1, 2], "FP32")
        tensor.set_data_from_numpy(data)
        assert client.infer("echo", [tensor]).as_numpy("OUTPUT0").tolist() == data.tolist()
        calls += 1
        time.sleep(0.05)
    channel.close()
    # Every call succeeded while the server sent GOAWAY after 300 ms: the channel connected more than once.
    assert calls > 10
    assert states.count(grpc.ChannelConnectivity.READY) >= 2, states
