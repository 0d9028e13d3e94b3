"""The worker pool under stress: large tensors, killed workers, and shutdown during load."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.support import GeserveProcess, write_identity_model

pytestmark = [pytest.mark.e2e, pytest.mark.one_layout]
Launch = Callable[..., GeserveProcess]
WORKER_UP = re.compile(r"instance (\S+) of model '(\S+)' is up \(pid (\d+)\)")


def worker_pids(server: GeserveProcess, model: str) -> dict[str, int]:
    """The latest pid of each instance of `model`, from the server's log."""
    pids: dict[str, int] = {}
    for instance, name, pid in WORKER_UP.findall(server.log()):
        if name == model:
            pids[instance] = int(pid)
    return pids


def test_large_tensors_round_trip_bit_exact(launch: Launch, repository: Path) -> None:
    write_identity_model(repository, "large", dtype="TYPE_FP32", dims="-1", max_batch_size=0)
    server = launch(f"--model-repository={repository}", f"--http-max-input-size={80 << 20}").wait_live()
    data = np.random.default_rng(7).standard_normal(16 << 20, dtype=np.float32)  # 64 MiB
    http = httpclient.InferenceServerClient(server.url, network_timeout=120, connection_timeout=120)
    tensor = httpclient.InferInput("INPUT0", list(data.shape), "FP32")
    tensor.set_data_from_numpy(data)
    output = http.infer("large", [tensor]).as_numpy("OUTPUT0")
    assert output is not None and output.tobytes() == data.tobytes()
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    grpc_tensor = grpcclient.InferInput("INPUT0", list(data.shape), "FP32")
    grpc_tensor.set_data_from_numpy(data[::-1].copy())
    output = grpc.infer("large", [grpc_tensor], client_timeout=120).as_numpy("OUTPUT0")
    assert output is not None and output.tobytes() == data[::-1].tobytes()


def _int32_identity(repository: Path, name: str, **options: Any) -> None:
    """An identity model of INT32 [4] in batches of up to 8, what Load sends; `options` as write_identity_model's."""
    write_identity_model(repository, name, dtype="TYPE_INT32", dims="4", max_batch_size=8, **options)


class Load:
    """Threads sending requests in a loop, each checking that its answer carries its own values."""

    def __init__(self, server: GeserveProcess, model: str, threads: int) -> None:
        self.server, self.model = server, model
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.results: list[tuple[float, float, str]] = []  # (sent, answered, "ok" or the error)
        self.wrong_values = 0
        self.threads = [threading.Thread(target=self._run, args=(n,)) for n in range(threads)]

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)
        assert not any(thread.is_alive() for thread in self.threads), "a request hung"

    def _run(self, number: int) -> None:
        client = httpclient.InferenceServerClient(self.server.url, network_timeout=30)
        value = number * 1_000_000
        while not self.stop.is_set():
            value += 1
            data = np.full((1, 4), value, dtype=np.int32)
            tensor = httpclient.InferInput("INPUT0", [1, 4], "INT32")
            tensor.set_data_from_numpy(data)
            sent = time.monotonic()
            try:
                output = client.infer(self.model, [tensor]).as_numpy("OUTPUT0")
                outcome = "ok"
                if output is None or not np.array_equal(output, data):
                    with self.lock:
                        self.wrong_values += 1
            except InferenceServerException as error:
                outcome = f"{error.status()} {error.message()}"
            except Exception as error:  # connection refused once the server is gone
                outcome = f"connection: {type(error).__name__}"
            with self.lock:
                self.results.append((sent, time.monotonic(), outcome))


def test_killed_worker_under_load(launch: Launch, repository: Path) -> None:
    _int32_identity(
        repository, "pool", delay_ms=20, extra="dynamic_batching { } instance_group [ { count: 2 kind: KIND_CPU } ]"
    )
    server = launch(f"--model-repository={repository}").wait_live()
    pids = worker_pids(server, "pool")
    assert len(pids) == 2
    victim, victim_pid = sorted(pids.items())[0]
    with Load(server, "pool", threads=6) as load:
        time.sleep(1.0)
        killed_at = time.monotonic()
        os.kill(victim_pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while worker_pids(server, "pool").get(victim) == victim_pid:
            assert time.monotonic() < deadline, "the worker was not restarted"
            time.sleep(0.1)
        time.sleep(1.0)  # load on the restarted pool
    assert load.wrong_values == 0
    failures = [outcome for _, _, outcome in load.results if outcome != "ok"]
    assert all(f.startswith("503 ") and f"instance '{victim}' of model 'pool' version 1" in f for f in failures), (
        failures
    )
    assert len(failures) <= 6  # only the batch in flight on the killed worker
    late = [outcome for sent, _, outcome in load.results if sent > killed_at + 0.5]
    assert late and all(outcome == "ok" for outcome in late)
    assert httpclient.InferenceServerClient(server.url).is_model_ready("pool")
    assert f"instance '{victim}' of model 'pool' version 1 exited unexpectedly" in server.log()


def test_a_model_whose_only_worker_restarts_is_unavailable_not_unknown(launch: Launch, repository: Path) -> None:
    """While its one instance restarts, a known model answers 503 / UNAVAILABLE, so clients retry."""
    _int32_identity(repository, "lonely")
    server = launch(f"--model-repository={repository}").wait_live()
    ((victim, victim_pid),) = worker_pids(server, "lonely").items()
    http = httpclient.InferenceServerClient(server.url)
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    data = np.arange(4, dtype=np.int32).reshape(1, 4)
    http_input = httpclient.InferInput("INPUT0", [1, 4], "INT32")
    http_input.set_data_from_numpy(data)
    grpc_input = grpcclient.InferInput("INPUT0", [1, 4], "INT32")
    grpc_input.set_data_from_numpy(data)
    os.kill(victim_pid, signal.SIGKILL)
    seen: set[tuple[str, str]] = set()
    deadline = time.monotonic() + 30
    while worker_pids(server, "lonely").get(victim) == victim_pid or not http.is_model_ready("lonely"):
        assert time.monotonic() < deadline, "the worker was not restarted"
        for call in (lambda: http.infer("lonely", [http_input]), lambda: grpc.infer("lonely", [grpc_input])):
            try:
                call()
            except InferenceServerException as error:
                seen.add((str(error.status()), error.message()))
        time.sleep(0.05)
    assert seen, "no request met the restart"
    assert ("503", "'lonely' version 1 is not at ready state") in seen, seen
    for status, message in seen:  # a request caught in flight may fail with the instance's own 503
        assert status in ("503", "StatusCode.UNAVAILABLE") and "unknown model" not in message, (status, message)
    np.testing.assert_array_equal(http.infer("lonely", [http_input]).as_numpy("OUTPUT0"), data)


def test_sigterm_during_load_finishes_accepted_requests(launch: Launch, repository: Path) -> None:
    _int32_identity(repository, "drain", delay_ms=300, extra="dynamic_batching { max_queue_delay_microseconds: 20000 }")
    server = launch(f"--model-repository={repository}").wait_live()
    with Load(server, "drain", threads=8) as load:
        time.sleep(1.0)
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        assert server.wait_exit(60) == 0
    before = [outcome for sent, _, outcome in load.results if sent < signalled - 0.05]
    assert before and all(outcome == "ok" for outcome in before), before
    assert load.wrong_values == 0
    log = server.log()
    assert "shutting down" in log
