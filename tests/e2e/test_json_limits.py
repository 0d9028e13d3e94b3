"""JSON is bounded (--http-max-json-size): an infer request's JSON header or a generate body past it gets 413 naming
the flag, binary tensors of any size within --http-max-input-size are not, and the server serves on."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.support import GeserveProcess, start_echo

pytestmark = pytest.mark.e2e

Launch = Callable[..., GeserveProcess]
LIMIT = 100_000


def _post(server: GeserveProcess, path: str, body: bytes) -> tuple[int, dict[str, object]]:
    request = urllib.request.Request(f"http://{server.url}{path}", data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        with error:
            return error.code, json.loads(error.read())


def _json_infer(values: int) -> bytes:
    data = [0.5] * values
    return json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, values], "datatype": "FP32", "data": data}]}).encode()


def test_json_past_its_limit_is_refused_with_413_and_binary_tensors_are_not(launch: Launch, repository: Path) -> None:
    server = start_echo(launch, repository, f"--http-max-json-size={LIMIT}")
    too_large = _json_infer(LIMIT // 4)
    status, body = _post(server, "/v2/models/echo/infer", too_large)
    assert status == 413, body
    assert body == {
        "error": f"Request JSON size of {len(too_large)} bytes exceeds the maximum allowed value of {LIMIT} bytes. "
        "Send large tensors as binary data (the binary tensor extension), or use --http-max-json-size to increase "
        "the limit."
    }
    status, body = _post(server, "/v2/models/echo/generate", json.dumps({"INPUT0": [[0.5] * (LIMIT // 4)]}).encode())
    assert status == 413 and "--http-max-json-size" in str(body["error"]), body
    # Right after: JSON within the limit, and a binary tensor ten times the JSON limit.
    status, body = _post(server, "/v2/models/echo/infer", _json_infer(100))
    assert status == 200 and body["outputs"][0]["data"] == [0.5] * 100, body  # type: ignore[index]
    client = httpclient.InferenceServerClient(server.url)
    large = np.arange(LIMIT * 10 // 4, dtype=np.float32).reshape(1, -1)
    tensor = httpclient.InferInput("INPUT0", list(large.shape), "FP32")
    tensor.set_data_from_numpy(large, binary_data=True)
    output = httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)
    np.testing.assert_array_equal(client.infer("echo", [tensor], outputs=[output]).as_numpy("OUTPUT0"), large)
    assert server.stop() == 0, server.log()
