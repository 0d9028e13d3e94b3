"""A load that never finishes (a warmup sample or an initialize that never returns) is given up by SIGTERM within
--exit-timeout-secs, and by an unload at once; a model stuck in execute at shutdown is killed within the timeout."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from geserve.http.app import SHUT_DOWN_UNFINISHED
from tests.support import (
    GeserveProcess,
    alive,
    config_text,
    descendants,
    segments_of_server,
    wait_until,
    write_identity_model,
    write_python_model,
)

pytestmark = pytest.mark.e2e

Launch = Callable[..., GeserveProcess]
EXIT_TIMEOUT_S = 4
# The bound the shutdown plan sets (--exit-timeout-secs, the workers' floor inside it) and what a loaded 2-core CI
# machine adds to starting and reaping processes: not a measurement, a deadline that used to be missed by minutes.
EXIT_BOUND_S = EXIT_TIMEOUT_S + 3

STUCK = """
import pathlib
import threading


class TritonPythonModel:
    def initialize(self, args):
        if {in_initialize!r}:
            pathlib.Path({marker!r}).touch()
            threading.Event().wait()

    def execute(self, requests):
        pathlib.Path({marker!r}).touch()  # a warmup sample reached the model
        threading.Event().wait()
"""
WARMUP = """
model_warmup [ { name: "forever" batch_size: 1
  inputs { key: "INPUT0" value: { data_type: TYPE_FP32 dims: [ 2 ] zero_data: true } } } ]
"""


def _stuck_model(repository: Path, in_initialize: bool) -> Path:
    marker = repository.parent / "stuck-loading"
    config = config_text(
        "stuck", backend="python", max_batch_size=1,
        inputs=[("INPUT0", "TYPE_FP32", "2")], outputs=[("OUTPUT0", "TYPE_FP32", "2")],
    ) + ("" if in_initialize else WARMUP)  # fmt: skip
    write_python_model(repository, "stuck", STUCK.format(marker=str(marker), in_initialize=in_initialize), config)
    return marker


@pytest.mark.parametrize("where", ["warmup", "initialize"])
def test_sigterm_while_a_startup_model_never_finishes_loading_exits_within_the_timeout(
    launch: Launch, repository: Path, where: str
) -> None:
    marker = _stuck_model(repository, in_initialize=where == "initialize")
    server = launch(f"--model-repository={repository}", f"--exit-timeout-secs={EXIT_TIMEOUT_S}")
    assert wait_until(marker.exists, 60), server.log()
    tree = descendants(server.process.pid)
    assert tree, "no worker started: the test proves nothing"
    started = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    status = server.wait_exit(60)
    took_s = time.monotonic() - started
    assert status == 0, server.log()
    assert took_s < EXIT_BOUND_S, (took_s, server.log())
    assert wait_until(lambda: not any(alive(child) for child in tree), 10)
    assert not segments_of_server(server.process.pid)


def test_unloading_a_model_while_it_warms_up_answers_at_once_and_gives_the_load_up(
    launch: Launch, repository: Path
) -> None:
    marker = _stuck_model(repository, in_initialize=False)
    write_identity_model(repository, "echo")
    server = launch(
        f"--model-repository={repository}", "--model-control-mode=explicit", "--load-model=echo"
    ).wait_live()
    outcome: list[str] = []

    def load() -> None:
        client = httpclient.InferenceServerClient(server.url, network_timeout=600)
        try:
            client.load_model("stuck")
            outcome.append("loaded")
        except InferenceServerException as error:
            outcome.append(str(error))

    loading = threading.Thread(target=load, daemon=True)
    loading.start()
    assert wait_until(marker.exists, 60), server.log()
    client = httpclient.InferenceServerClient(server.url, network_timeout=60)
    assert {"name": "stuck", "state": "LOADING"} in client.get_model_repository_index()
    started = time.monotonic()
    client.unload_model("stuck")
    assert time.monotonic() - started < EXIT_BOUND_S, server.log()
    loading.join(30)
    assert outcome and "failed to load 'stuck', unloaded while loading" in outcome[0], outcome
    assert not client.is_model_ready("stuck")
    # The server serves on, and nothing of the given-up load is left running.
    tensor = httpclient.InferInput("INPUT0", [1, 2], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 2), dtype=np.float32))
    np.testing.assert_array_equal(client.infer("echo", [tensor]).as_numpy("OUTPUT0"), np.ones((1, 2)))
    assert server.stop() == 0, server.log()


STUCK_EXECUTE = """
import pathlib
import threading


class TritonPythonModel:
    def execute(self, requests):
        pathlib.Path({marker!r}).touch()
        threading.Event().wait()
"""


def test_requests_still_running_at_the_deadline_get_tritons_error_and_no_traceback(
    launch: Launch, repository: Path
) -> None:
    """A request stuck in its model when --exit-timeout-secs runs out is answered with Triton's JSON error (HTTP)
    and UNAVAILABLE (gRPC) for a server that is shutting down, not a plain-text 500 and a traceback each."""
    marker = repository.parent / "stuck-executing"
    config = config_text(
        "stuck", backend="python", inputs=[("INPUT0", "TYPE_FP32", "-1")], outputs=[("OUTPUT0", "TYPE_FP32", "-1")]
    )
    write_python_model(repository, "stuck", STUCK_EXECUTE.format(marker=str(marker)), config)
    server = launch(f"--model-repository={repository}", f"--exit-timeout-secs={EXIT_TIMEOUT_S}").wait_live()
    answers: dict[str, str] = {}

    def over_http() -> None:
        body = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "FP32", "data": [1.0]}]})
        request = urllib.request.Request(f"http://{server.url}/v2/models/stuck/infer", data=body.encode())
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                answers["http"] = f"{response.status} {response.read().decode()}"
        except urllib.error.HTTPError as error:
            with error:
                answers["http"] = f"{error.code} {error.headers.get('content-type')} {error.read().decode()}"
        except OSError as error:
            answers["http"] = f"connection: {error}"

    def over_grpc() -> None:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        tensor = grpcclient.InferInput("INPUT0", [1], "FP32")
        tensor.set_data_from_numpy(np.ones(1, dtype=np.float32))
        try:
            client.infer("stuck", [tensor], client_timeout=120)
            answers["grpc"] = "answered"
        except InferenceServerException as error:
            answers["grpc"] = f"{error.status()} {error.message()}"

    threads = [threading.Thread(target=send, daemon=True) for send in (over_http, over_grpc)]
    for thread in threads:
        thread.start()
    assert wait_until(marker.exists, 30), server.log()
    time.sleep(0.5)  # both requests inside the model's (one) execute, or queued behind it
    server.process.send_signal(signal.SIGTERM)
    assert server.wait_exit(60) == 0, server.log()
    for thread in threads:
        thread.join(30)
    assert answers["http"].startswith("503 application/json"), answers
    assert json.loads(answers["http"].split(" ", 2)[2]) == {"error": SHUT_DOWN_UNFINISHED}
    assert answers["grpc"].startswith("StatusCode.UNAVAILABLE"), answers
    assert "Traceback" not in server.log() and "Exception in ASGI application" not in server.log(), server.log()
