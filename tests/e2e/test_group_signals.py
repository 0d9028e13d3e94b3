"""Signals an operator's tools send: SIGTERM to the whole process group (systemd's KillMode=control-group, a
terminal's Ctrl-C, `tini -g`) drains like one to the server; a server killed outright, or stuck on a model while
it shuts down, leaves no process of it behind and exits within --exit-timeout-secs."""

from __future__ import annotations

import collections
import contextlib
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.support import (
    EchoLoad,
    GeserveProcess,
    alive,
    config_text,
    descendants,
    http_status,
    segments_of_server,
    wait_until,
    write_identity_model,
    write_python_model,
)

pytestmark = pytest.mark.e2e

Launch = Callable[..., GeserveProcess]

# A python model whose execute never returns: the shutdown waits on it, and must give up on it in time.
STUCK_MODEL = """
import pathlib
import threading


class TritonPythonModel:
    def execute(self, requests):
        pathlib.Path({marker!r}).touch()  # the test waits for it: the request is inside the model now
        threading.Event().wait()
"""
STUCK_CONFIG = config_text(
    "stuck", backend="python", inputs=[("INPUT0", "TYPE_FP32", "-1")], outputs=[("OUTPUT0", "TYPE_FP32", "-1")]
)


def _write_stuck_model(repository: Path) -> Path:
    """The model `stuck`; the file its execute creates when a request reaches it."""
    marker = repository.parent / "stuck-executing"
    write_python_model(repository, "stuck", STUCK_MODEL.format(marker=str(marker)), STUCK_CONFIG)
    return marker


def _send_stuck_request(server: GeserveProcess) -> threading.Thread:
    """A request to `stuck` in the background: it is in the model's execute once the thread has sent it."""

    def send() -> None:
        client = httpclient.InferenceServerClient(server.url, network_timeout=600)
        tensor = httpclient.InferInput("INPUT0", [2], "FP32")
        tensor.set_data_from_numpy(np.ones(2, dtype=np.float32))
        with contextlib.suppress(Exception), contextlib.closing(client):  # it never gets an answer
            client.infer("stuck", [tensor])

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def test_sigterm_to_the_process_group_while_clients_send_drains_with_no_failure(
    launch: Launch, repository: Path
) -> None:
    """Every process of the server gets the signal at once; only the one the user started acts on it."""
    drain_s = 3
    write_identity_model(repository, "echo")
    server = launch(f"--model-repository={repository}", f"--drain-delay-secs={drain_s}", new_session=True)
    server.wait_live()
    tree = descendants(server.process.pid)
    assert tree, "the server started no worker: the test proves nothing"
    outcomes: collections.Counter[str] = collections.Counter()
    stop = threading.Event()

    def grpc_client() -> None:
        with contextlib.closing(grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")) as client:
            sent = 0
            while not stop.is_set():
                sent += 1
                data = np.array([[float(sent), 1.0]], dtype=np.float32)
                tensor = grpcclient.InferInput("INPUT0", [1, 2], "FP32")
                tensor.set_data_from_numpy(data)
                try:
                    same = np.array_equal(client.infer("echo", [tensor]).as_numpy("OUTPUT0"), data)
                    outcomes["ok" if same else "wrong"] += 1
                except Exception as error:  # counted: the assertion below shows it
                    outcomes[str(error)[:120]] += 1

    threads = [threading.Thread(target=grpc_client) for _ in range(2)]
    with EchoLoad(server, threads=2) as load:
        for thread in threads:
            thread.start()
        assert wait_until(lambda: load.outcomes["ok"] > 50 and outcomes["ok"] > 50)
        os.killpg(server.process.pid, signal.SIGTERM)
        assert wait_until(lambda: http_status(f"http://{server.url}/v2/health/ready") != 200, drain_s)
        before = load.outcomes["ok"] + outcomes["ok"]
        # Served while draining: the workers did not take the group's signal as theirs.
        assert wait_until(lambda: load.outcomes["ok"] + outcomes["ok"] > before + 50, drain_s)
        stop.set()
        for thread in threads:
            thread.join()
    pid = server.process.pid
    assert server.wait_exit(60) == 0, server.log()
    assert set(load.outcomes) == {"ok"}, load.outcomes
    assert set(outcomes) == {"ok"}, outcomes
    assert "exited unexpectedly" not in server.log(), server.log()
    assert wait_until(lambda: not any(alive(child) for child in tree), 10)
    assert not segments_of_server(pid)


def test_sigkill_while_the_shutdown_waits_on_a_stuck_model_leaves_no_process(launch: Launch, repository: Path) -> None:
    """The worker is inside the model's execute, reading nothing: it must still go when the server does."""
    marker = _write_stuck_model(repository)
    server = launch(f"--model-repository={repository}", "--exit-timeout-secs=600").wait_live()
    tree = descendants(server.process.pid)
    _send_stuck_request(server)
    assert wait_until(marker.exists), server.log()
    server.process.send_signal(signal.SIGTERM)
    assert wait_until(lambda: "shutting down" in server.log()), server.log()
    server.process.kill()
    server.process.wait(30)
    assert wait_until(lambda: not any(alive(child) for child in tree), 10), [c for c in tree if alive(c)]


def test_a_shutdown_stuck_on_a_model_ends_within_the_exit_timeout(launch: Launch, repository: Path) -> None:
    """Front-ends, the scheduler's drain and the workers' stop share one --exit-timeout-secs, as in Triton."""
    exit_timeout_s = 6
    marker = _write_stuck_model(repository)
    server = launch(f"--model-repository={repository}", f"--exit-timeout-secs={exit_timeout_s}").wait_live()
    tree = descendants(server.process.pid)
    _send_stuck_request(server)
    assert wait_until(marker.exists), server.log()
    started = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    status = server.wait_exit(60)
    took_s = time.monotonic() - started
    log = server.log()
    assert status == 0, log
    # Not a timing assertion: a shutdown that spends the timeout once per stage takes 3 or 4 times it.
    assert took_s < 2 * exit_timeout_s, (took_s, log)
    assert re.search(r"instance stuck_0 did not stop in [\d.]+s; killing it", log), log
    assert wait_until(lambda: not any(alive(child) for child in tree), 10)
