"""The HTTP app at the ASGI level over an in-process service: routes, codecs and error mapping, no socket."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
import pytest
import tritonclient.http as httpclient

from geserve.core.api import InferenceAPI
from geserve.http.app import HttpApp, create_app
from geserve.settings import HttpSettings, Restriction


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)


async def _call(
    app: HttpApp, method: str, path: str, body: bytes = b"", headers: Iterable[tuple[str, str]] = ()
) -> Answer:
    """One request through the ASGI interface, as uvicorn would make it (the body in one message)."""
    target, _, query = path.partition("?")
    raw_headers = [(k.lower().encode(), v.encode()) for k, v in (*headers, ("content-length", str(len(body))))]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": target,
        "raw_path": target.encode(),
        "root_path": "",
        "query_string": query.encode(),
        "headers": raw_headers,
        "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 50000),
    }
    pending = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if pending:
            return pending.pop()
        await asyncio.Event().wait()  # the client stays connected
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    start = sent[0]
    headers_out = {k.decode().lower(): v.decode() for k, v in start.get("headers", [])}
    return Answer(start["status"], headers_out, b"".join(m.get("body", b"") for m in sent[1:]))


@pytest.fixture
def app(service: InferenceAPI) -> HttpApp:
    return create_app(service, HttpSettings())


def _binary_infer(values: np.ndarray) -> tuple[bytes, dict[str, str]]:
    tensor = httpclient.InferInput("INPUT0", list(values.shape), "FP32")
    tensor.set_data_from_numpy(values, binary_data=True)
    output = httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)
    body, json_size = httpclient.InferenceServerClient.generate_request_body([tensor], [output])
    return body, {"Inference-Header-Content-Length": str(json_size)}


async def test_health_metadata_and_config(app: HttpApp) -> None:
    assert (await _call(app, "GET", "/v2/health/live")).status == 200
    assert (await _call(app, "GET", "/v2/health/ready")).status == 200
    server = (await _call(app, "GET", "/v2")).json()
    assert server["name"] == "triton" and "binary_tensor_data" in server["extensions"]
    metadata = (await _call(app, "GET", "/v2/models/simple/versions/1")).json()
    assert metadata["name"] == "simple" and [i["name"] for i in metadata["inputs"]] == ["INPUT0", "INPUT1"]
    assert (await _call(app, "GET", "/v2/models/echo/ready")).status == 200
    assert (await _call(app, "GET", "/v2/models/simple/config")).json()["max_batch_size"] == 8


async def test_json_and_binary_infer_answer_each_request_with_its_values(app: HttpApp) -> None:
    request = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 3], "data": [1.5, 2.5, 3.5]}]}
    answer = await _call(app, "POST", "/v2/models/echo/infer", orjson.dumps({**request, "id": "j1"}))
    assert answer.status == 200, answer.body
    assert answer.json()["id"] == "j1" and answer.json()["outputs"][0]["data"] == [1.5, 2.5, 3.5]
    values = np.arange(8, dtype=np.float32).reshape(2, 4)
    body, headers = _binary_infer(values)
    answer = await _call(app, "POST", "/v2/models/echo/infer", body, headers.items())
    assert answer.status == 200, answer.body
    header_size = int(answer.headers["inference-header-content-length"])
    result = httpclient.InferResult.from_response_body(answer.body, header_length=header_size)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), values)


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "message"),
    [
        ("GET", "/v2/models/nope", b"", 400, "Request for unknown model: 'nope' is not found"),
        ("POST", "/v2/models/nope/infer", b'{"inputs": []}', 400, "Request for unknown model: 'nope' is not found"),
        ("POST", "/v2/models/echo/infer", b"{not json", 400, ""),
        # Triton's routes take only digits for a version: anything else is no route at all.
        ("POST", "/v2/models/echo/versions/x/infer", b'{"inputs": []}', 404, "Not Found"),
        ("GET", "/v2/models/echo/versions/9/stats", b"", 404, "'echo' version 9 is not found"),
        ("POST", "/v2/repository/models/nope/load", b"", 500, "failed to load 'nope', failed to poll from model"),
    ],
)
async def test_a_bad_request_gets_triton_s_error_and_the_next_good_one_is_served(
    app: HttpApp, method: str, path: str, body: bytes, status: int, message: str
) -> None:
    answer = await _call(app, method, path, body)
    assert answer.status == status, answer.body
    assert message in answer.json()["error"]
    values = np.ones((1, 2), dtype=np.float32)
    body, headers = _binary_infer(values)
    assert (await _call(app, "POST", "/v2/models/echo/infer", body, headers.items())).status == 200


async def test_statistics_repository_and_extensions(app: HttpApp) -> None:
    body, headers = _binary_infer(np.ones((1, 2), dtype=np.float32))
    await _call(app, "POST", "/v2/models/echo/infer", body, headers.items())
    [stats] = (await _call(app, "GET", "/v2/models/echo/stats")).json()["model_stats"]
    assert stats["inference_stats"]["success"]["count"] == 1
    index = (await _call(app, "POST", "/v2/repository/index", b"{}")).json()
    assert {entry["name"] for entry in index} == {"echo", "simple"}
    assert (await _call(app, "GET", "/v2/systemsharedmemory/status")).json() == []
    assert "log_verbose_level" in (await _call(app, "GET", "/v2/logging")).json()
    assert (await _call(app, "GET", "/v2/trace/setting")).status == 200


async def test_a_restricted_api_is_refused_before_the_body_is_read(service: InferenceAPI) -> None:
    restricted = {"model-repository": Restriction("admin-key", "secret")}
    app = create_app(service, HttpSettings(restrictions=restricted))
    answer = await _call(app, "POST", "/v2/repository/index", b"{}")
    assert answer.status == 403 and "expecting header 'admin-key'" in answer.json()["error"]
    allowed = await _call(app, "POST", "/v2/repository/index", b"{}", [("admin-key", "secret")])
    assert allowed.status == 200
