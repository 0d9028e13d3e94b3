"""Triton's generate extension (`/generate`, `/generate_stream`) on a real geserve, read by a plain HTTP client
as `requests` or `httpx` would: one JSON object, or Server-Sent Events read as they arrive."""

from __future__ import annotations

import http.client
import json
import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient

from geserve.http.generate import ENCODING_REFUSAL, NOT_ONE_RESPONSE
from tests.e2e.test_trace_file import HTTP_NAMES, _check, _traces, start_traced
from tests.support import GeserveProcess, copy_model

pytestmark = pytest.mark.e2e

PYTHON_MODELS = Path(__file__).resolve().parents[1] / "python_models"
EVENT_STREAM = "text/event-stream; charset=utf-8"
SIMPLE = {"INPUT0": list(range(16)), "INPUT1": [1] * 16}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GeserveProcess]:
    root = tmp_path_factory.mktemp("generate")
    repository = root / "models"
    repository.mkdir()
    for name in ("simple", "simple_string", "repeat_int32", "digits", "digits_preprocess", "digits_postprocess"):
        copy_model(name, repository)
    copy_model("digits_ensemble", repository)
    for name in ("cancellable", "echo_parameters"):
        shutil.copytree(PYTHON_MODELS / name, repository / name)
    process = GeserveProcess(root / "geserve.log", f"--model-repository={repository}").wait_live()
    yield process
    assert process.stop() == 0, process.log()


class Answer:
    """A whole HTTP answer: status, content type and body."""

    def __init__(self, response: http.client.HTTPResponse) -> None:
        self.status = response.status
        self.content_type = response.getheader("content-type")
        self.body = response.read()

    def json(self) -> Any:
        return json.loads(self.body)


def _connect(server: GeserveProcess) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)


def _send(connection: http.client.HTTPConnection, path: str, body: Any, headers: dict[str, str] | None = None) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    connection.request("POST", path, body=data, headers={"Content-Type": "application/json", **(headers or {})})


def post(server: GeserveProcess, path: str, body: Any, headers: dict[str, str] | None = None) -> Answer:
    connection = _connect(server)
    try:
        _send(connection, path, body, headers)
        return Answer(connection.getresponse())
    finally:
        connection.close()


def events(response: http.client.HTTPResponse) -> Iterator[Any]:
    """Each `data:` event of an event stream, parsed, as soon as its blank line arrives."""
    data: list[bytes] = []
    for raw in iter(response.readline, b""):
        line = raw.rstrip(b"\r\n")
        if line:
            assert line.startswith(b"data: "), line
            data.append(line.removeprefix(b"data: "))
        elif data:
            yield json.loads(b"\n".join(data))
            data = []
    assert not data, "the stream ended inside an event"


def stream(server: GeserveProcess, path: str, body: Any) -> tuple[int, str | None, list[Any]]:
    connection = _connect(server)
    try:
        _send(connection, path, body, {"Accept": "text/event-stream"})
        response = connection.getresponse()
        return response.status, response.getheader("content-type"), list(events(response))
    finally:
        connection.close()


def _simple_works(server: GeserveProcess) -> None:
    answer = post(server, "/v2/models/simple/generate", SIMPLE)
    assert answer.status == 200, answer.body
    assert answer.json()["OUTPUT0"] == [value + 1 for value in range(16)]


# -- answers ---------------------------------------------------------------------------------------


def test_generate_answers_one_json_object_with_outputs_by_name(server: GeserveProcess) -> None:
    for path in ("/v2/models/simple/generate", "/v2/models/simple/versions/1/generate"):
        answer = post(server, path, SIMPLE)
        assert (answer.status, answer.content_type) == (200, "application/json"), answer.body
        assert answer.json() == {
            "model_name": "simple",
            "model_version": "1",
            "OUTPUT0": [value + 1 for value in range(16)],
            "OUTPUT1": [value - 1 for value in range(16)],
        }


def test_generate_stream_of_a_model_that_is_not_decoupled_is_one_event(server: GeserveProcess) -> None:
    status, content_type, received = stream(server, "/v2/models/simple/generate_stream", {**SIMPLE, "id": "one"})
    assert (status, content_type) == (200, EVENT_STREAM)
    assert [event["OUTPUT0"] for event in received] == [[value + 1 for value in range(16)]]
    assert received[0]["id"] == "one"


def test_generate_stream_sends_an_event_per_response_of_a_decoupled_model(server: GeserveProcess) -> None:
    values = [4, -2, 9, 0, 7]
    body = {"IN": values, "DELAY": [1] * len(values), "WAIT": 0}
    status, content_type, received = stream(server, "/v2/models/repeat_int32/generate_stream", body)
    assert (status, content_type) == (200, EVENT_STREAM)
    # One element per output: the element itself, not a one-element array, as Triton answers.
    assert received == [
        {"model_name": "repeat_int32", "model_version": "1", "OUT": value, "IDX": index}
        for index, value in enumerate(values)
    ]
    _simple_works(server)


def test_bytes_tensors_are_strings_both_ways(server: GeserveProcess) -> None:
    body = {"INPUT0": [str(value) for value in range(16)], "INPUT1": ["2"] * 16}
    answer = post(server, "/v2/models/simple_string/generate", body)
    assert answer.status == 200, answer.body
    assert answer.json()["OUTPUT0"] == [str(value + 2) for value in range(16)]
    assert answer.json()["OUTPUT1"] == [str(value - 2) for value in range(16)]


def test_an_ensemble_answers_as_over_infer(server: GeserveProcess) -> None:
    image = np.random.default_rng(5).integers(0, 256, size=(1, 8, 8), dtype=np.uint8)
    tensor = httpclient.InferInput("IMAGE", [1, 8, 8], "UINT8")
    tensor.set_data_from_numpy(image)
    expected = httpclient.InferenceServerClient(server.url).infer("digits_ensemble", [tensor])
    answer = post(server, "/v2/models/digits_ensemble/generate", {"IMAGE": image.reshape(-1).tolist()})
    assert answer.status == 200, answer.body
    assert answer.json()["LABEL"] == expected.as_numpy("LABEL")[0, 0].decode()
    assert answer.json()["SCORE"] == pytest.approx(float(expected.as_numpy("SCORE")[0, 0]), rel=1e-6)


def test_keys_that_name_no_input_and_the_parameters_object_reach_the_model_as_parameters(
    server: GeserveProcess,
) -> None:
    body = {"IN": 3, "id": "g-1", "temperature": 0.5, "parameters": {"stream": False, "top_k": 3, "mode": "x"}}
    answer = post(server, "/v2/models/echo_parameters/generate", body)
    assert answer.status == 200, answer.body
    result = answer.json()
    assert result["id"] == result["REQUEST_ID"] == "g-1"
    # As Triton's: `id` names the request and, naming no input, is a parameter too.
    assert json.loads(result["PARAMETERS"]) == {
        "id": "g-1",
        "temperature": 0.5,
        "stream": False,
        "top_k": 3,
        "mode": "x",
    }


def test_the_server_advertises_generate(server: GeserveProcess) -> None:
    assert "generate" in httpclient.InferenceServerClient(server.url).get_server_metadata()["extensions"]


# -- decoupled models on /generate -------------------------------------------------------------------


def test_generate_on_a_decoupled_model_needs_exactly_one_response(server: GeserveProcess) -> None:
    one = post(server, "/v2/models/repeat_int32/generate", {"IN": [5], "DELAY": [0], "WAIT": 0})
    assert one.status == 200 and one.json() == {"model_name": "repeat_int32", "model_version": "1", "OUT": 5, "IDX": 0}
    # Triton's answer starts with the first response's status, so more (or fewer) responses are a 200
    # whose body is the error.
    for values in ([5, 6, 7], []):
        many = post(server, "/v2/models/repeat_int32/generate", {"IN": values, "DELAY": [0] * len(values), "WAIT": 0})
        assert (many.status, many.content_type) == (200, "application/json")
        assert many.json() == {"error": NOT_ONE_RESPONSE}
    _simple_works(server)


def test_a_response_error_is_an_event_and_sets_the_status_when_it_comes_first(server: GeserveProcess) -> None:
    status, content_type, received = stream(
        server, "/v2/models/repeat_int32/generate_stream", {"IN": [1, 2], "DELAY": [1], "WAIT": 0}
    )
    assert (status, content_type) == (400, EVENT_STREAM)
    assert received == [{"error": "expected IN and DELAY shapes to match, got [2] and [1]"}]
    _simple_works(server)


# -- errors before any response -----------------------------------------------------------------------

ERRORS: list[tuple[str, Any, int, str]] = [
    ("simple", b'{"INPUT0": [1,', 400, "failed to parse the request JSON buffer: "),
    ("simple", b"[1, 2]", 500, "attempt to get members for non-object"),
    ("nope", SIMPLE, 400, "Request for unknown model: 'nope' is not found"),
    (
        "simple",
        {**SIMPLE, "NOPE": [1, 2]},
        400,
        "parameter 'NOPE' has invalid type. It should be either 'int', 'bool', or 'string'.",
    ),
    ("simple", {"INPUT0": list(range(16))}, 400, "expected 2 inputs but got 1 inputs for model 'simple'"),
    (
        "simple",
        {**SIMPLE, "INPUT0": ["1"] * 16},
        500,
        "Unable to parse 'data': attempt to access JSON non-signed-integer as signed-integer",
    ),
    (
        "simple",
        {**SIMPLE, "INPUT0": [0.5] * 16},
        500,
        "Unable to parse 'data': attempt to access JSON non-signed-integer as signed-integer",
    ),
    (
        "simple_string",
        {"INPUT0": [1] * 16, "INPUT1": ["1"] * 16},
        500,
        "Unable to parse JSON bytes array: attempt to access JSON non-string as string",
    ),
    (
        "repeat_int32",
        {"IN": [1], "DELAY": [-1], "WAIT": 0},
        500,
        "Unable to parse 'data': attempt to access JSON non-unsigned-integer as unsigned-integer",
    ),
    (
        "repeat_int32",
        {"IN": [1 << 40], "DELAY": [0], "WAIT": 0},
        400,
        "Unable to parse 'data': a value of input 'IN' is out of range for INT32",
    ),
    (
        "simple",
        {**SIMPLE, "INPUT0": list(range(15))},
        400,
        "The schema can not convert input 'INPUT0' to tensor with proper shape",
    ),
    (
        "repeat_int32",
        {"IN": [1], "DELAY": [0], "WAIT": [0, 0]},
        400,
        "The schema can not convert input 'WAIT' to tensor with proper shape",
    ),
    (
        "simple",
        b'{"INPUT0": [0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0], "INPUT0": [1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1]}',
        400,
        "input 'INPUT0' already exists in request",
    ),
    (
        "simple",
        {**SIMPLE, "parameters": 1},
        500,
        "Expected JSON object for keyword: 'parameters': attempt to access JSON non-object as object",
    ),
    (
        "simple",
        {**SIMPLE, "parameters": {"nested": {"twice": 1}}},
        400,
        "Converting keyword: 'parameters': parameter 'nested' has invalid type.",
    ),
    ("simple", {**SIMPLE, "triton_x": 1}, 400, "parameter keys starting with 'triton_' are reserved for Triton usage"),
]


@pytest.mark.parametrize("action", ["generate", "generate_stream"])
@pytest.mark.parametrize(("model", "body", "status", "text"), ERRORS, ids=[error[3][:40] for error in ERRORS])
def test_bad_requests_get_tritons_status_and_text_and_a_good_one_works_after(
    server: GeserveProcess, action: str, model: str, body: Any, status: int, text: str
) -> None:
    answer = post(server, f"/v2/models/{model}/{action}", body)
    assert (answer.status, answer.content_type) == (status, "application/json"), answer.body
    assert text in answer.json()["error"]
    _simple_works(server)


def test_unknown_versions_methods_and_encodings(server: GeserveProcess) -> None:
    answer = post(server, "/v2/models/simple/versions/9/generate", SIMPLE)
    assert (answer.status, answer.json()) == (
        404,
        {"error": "Request for unknown model: 'simple' version 9 is not found"},
    )
    connection = _connect(server)
    connection.request("GET", "/v2/models/simple/generate_stream")
    answer = Answer(connection.getresponse())
    connection.close()
    assert (answer.status, answer.json()) == (405, {"error": "Method Not Allowed"})
    answer = post(server, "/v2/models/simple/generate", SIMPLE, {"Content-Encoding": "gzip"})
    assert (answer.status, answer.json()) == (400, {"error": ENCODING_REFUSAL})
    _simple_works(server)


# -- a client that goes away --------------------------------------------------------------------------


def _wait_for(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_client_that_leaves_mid_stream_cancels_the_request_in_the_model(server: GeserveProcess) -> None:
    log_before = len(server.log())
    connection = _connect(server)
    _send(connection, "/v2/models/cancellable/generate_stream", {"COUNT": 500, "id": "gen-away"})
    response = connection.getresponse()
    assert (response.status, response.getheader("content-type")) == (200, EVENT_STREAM)
    received = events(response)
    assert [next(received)["INDEX"] for _ in range(3)] == [0, 1, 2]  # streamed as the model sends them
    connection.sock.close()  # type: ignore[union-attr]  # gone mid-stream, as a closed browser tab
    connection.close()
    _wait_for(lambda: "request gen-away cancelled after" in server.log(), "the model never saw the cancellation")
    sent = int(re.search(r"request gen-away cancelled after (\d+) responses", server.log()).group(1))  # type: ignore[union-attr]
    assert 3 <= sent < 500
    _simple_works(server)
    assert "Traceback" not in server.log()[log_before:]


def test_a_client_that_leaves_before_the_answer_cancels_generate_too(server: GeserveProcess) -> None:
    log_before = len(server.log())
    executed = _executions(server)
    connection = _connect(server)
    _send(connection, "/v2/models/cancellable/generate", {"COUNT": 500, "id": "gen-waits"})
    _wait_for(lambda: _executions(server) > executed, "the request never reached the model")
    connection.sock.close()  # type: ignore[union-attr]
    connection.close()
    _wait_for(lambda: "request gen-waits cancelled after" in server.log(), "the model never saw the cancellation")
    _simple_works(server)
    assert "Traceback" not in server.log()[log_before:]


def _executions(server: GeserveProcess) -> int:
    stats = httpclient.InferenceServerClient(server.url).get_inference_statistics("cancellable")
    return int(stats["model_stats"][0]["execution_count"])


def test_restricted_inference_covers_generate(launch: Callable[..., GeserveProcess], tmp_path: Path) -> None:
    repository = tmp_path / "models"
    copy_model("simple", repository)
    restricted = launch(f"--model-repository={repository}", "--http-restricted-api=inference:infer-key=abc").wait_live()
    for action in ("generate", "generate_stream"):
        answer = post(restricted, f"/v2/models/simple/{action}", SIMPLE)
        assert (answer.status, answer.json()) == (
            403,
            {"error": "This API is restricted, expecting header 'infer-key'"},
        )
        assert post(restricted, f"/v2/models/simple/{action}", SIMPLE, {"infer-key": "abc"}).status == 200
    assert restricted.stop() == 0


def test_traced_generate_requests_get_the_http_timestamps(tmp_path: Path) -> None:
    repository = tmp_path / "models"
    copy_model("simple", repository)
    traced, trace_file = start_traced(tmp_path, repository)
    try:
        assert post(traced, "/v2/models/simple/generate", {**SIMPLE, "id": "traced-one"}).status == 200
        assert stream(traced, "/v2/models/simple/generate_stream", {**SIMPLE, "id": "traced-stream"})[0] == 200
    finally:
        assert traced.stop() == 0, traced.log()
    traces = _traces(trace_file)
    for request_id in ("traced-one", "traced-stream"):
        (trace,) = [trace for trace in traces.values() if trace["request_id"] == request_id]
        _check(trace, HTTP_NAMES)
