"""HTTP under fuzzed input: every request gets a 4xx or a correct answer, and a good request works after."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import struct
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support import GeserveProcess

DATATYPES = ["INT32", "FP32", "BYTES", "BOOL", "INT8", "UINT64", "FP16", "INT33", ""]
NAMES = ["INPUT0", "INPUT1", "OUTPUT0", ""]
# Text with lone surrogates: json.dumps writes them as \\ud800-style escapes.
TEXT = st.text(st.characters(codec=None, min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=()), max_size=12)
SCALARS = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | TEXT
JSON = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=6) | st.dictionaries(TEXT, inner, max_size=4), max_leaves=24
)
SHAPES = st.lists(st.integers(-2, 20), max_size=3) | st.just([1, 16])


def _post(server: GeserveProcess, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    try:
        connection.request("POST", path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def _good_request(server: GeserveProcess) -> None:
    data = list(range(16))
    body = {"inputs": [{"name": n, "datatype": "INT32", "shape": [1, 16], "data": data} for n in ("INPUT0", "INPUT1")]}
    status, answer = _post(server, "/v2/models/simple/infer", json.dumps(body).encode())
    assert status == 200, answer
    outputs = {o["name"]: o["data"] for o in json.loads(answer)["outputs"]}
    assert outputs["OUTPUT0"] == [2 * x for x in data]


def _answered_cleanly(status: int, answer: bytes) -> None:
    assert status < 500, (status, answer[:300])
    if status != 200 and answer.startswith(b"{"):  # the HTTP parser's own 400s are plain text
        assert json.loads(answer)["error"], answer


@st.composite
def infer_bodies(draw: st.DrawFn) -> dict[str, Any]:
    inputs = []
    for _ in range(draw(st.integers(0, 3))):
        tensor: dict[str, Any] = {
            "name": draw(st.sampled_from(NAMES) | TEXT),
            "datatype": draw(st.sampled_from(DATATYPES)),
            "shape": draw(SHAPES),
        }
        if draw(st.booleans()):
            tensor["data"] = draw(JSON | st.lists(st.integers(-5, 5), min_size=16, max_size=16))
        if draw(st.booleans()):
            tensor["parameters"] = draw(st.dictionaries(TEXT, SCALARS, max_size=3))
        inputs.append(tensor)
    body: dict[str, Any] = {"inputs": inputs}
    for key, strategy in (
        ("id", TEXT | SCALARS),
        ("parameters", JSON),
        (
            "outputs",
            st.lists(
                st.dictionaries(
                    st.sampled_from(["name", "parameters"]), st.sampled_from(NAMES) | TEXT | JSON, max_size=2
                ),
                max_size=3,
            ),
        ),
    ):
        if draw(st.booleans()):
            body[key] = draw(strategy)
    return body


@given(infer_bodies(), st.sampled_from(["simple", "simple_string"]))
def test_json_infer_bodies(fuzz_server: GeserveProcess, body: dict[str, Any], model: str) -> None:
    status, answer = _post(fuzz_server, f"/v2/models/{model}/infer", json.dumps(body, ensure_ascii=True).encode())
    _answered_cleanly(status, answer)
    _good_request(fuzz_server)


@given(JSON)
def test_arbitrary_json_documents(fuzz_server: GeserveProcess, document: Any) -> None:
    status, answer = _post(fuzz_server, "/v2/models/simple/infer", json.dumps(document).encode())
    _answered_cleanly(status, answer)


# Header values travel as latin-1; what http.client can send at all.
HEADER_TEXT = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=4)


@given(st.binary(max_size=300), st.integers(-10, 400) | HEADER_TEXT)
def test_binary_infer_format(fuzz_server: GeserveProcess, tail: bytes, declared: int | str) -> None:
    header = {
        "inputs": [
            {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "parameters": {"binary_data_size": 64}},
            {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "parameters": {"binary_data_size": 64}},
        ]
    }
    encoded = json.dumps(header).encode()
    body = encoded + struct.pack("<16i", *range(16)) + tail
    length = str(declared if isinstance(declared, str) else len(encoded) + declared - 200)
    status, answer = _post(fuzz_server, "/v2/models/simple/infer", body, {"Inference-Header-Content-Length": length})
    _answered_cleanly(status, answer)
    _good_request(fuzz_server)


@settings(max_examples=40)
@given(
    st.dictionaries(
        st.sampled_from(
            [
                "max_batch_size",
                "input",
                "output",
                "instance_group",
                "name",
                "backend",
                "dynamic_batching",
                "parameters",
                "version_policy",
            ]
        ),
        JSON,
        max_size=3,
    )
    | JSON
)
def test_config_overrides(fuzz_server: GeserveProcess, config: Any) -> None:
    body = json.dumps({"parameters": {"config": json.dumps(config)}}).encode()
    status, answer = _post(fuzz_server, "/v2/repository/models/simple/load", body)
    assert status in (200, 400), (status, answer[:300])
    _good_request(fuzz_server)


@given(
    TEXT, TEXT | st.sampled_from(["/geserve_x", "/dev/shm", "..", "/", "/x/y"]), st.integers(-(2**64), 2**64), SCALARS
)
def test_shared_memory_registration(fuzz_server: GeserveProcess, name: str, key: str, offset: int, size: Any) -> None:
    body = json.dumps({"key": key, "offset": offset, "byte_size": size}, ensure_ascii=True).encode()
    status, answer = _post(fuzz_server, f"/v2/systemsharedmemory/region/{np.random.randint(1 << 30)}/register", body)
    assert status in (200, 400, 404), (status, answer[:300])
    assert status != 200, "no fuzzed key names a real segment"


HEADER_CAP = 64 << 10  # --http-max-header-size's default


@settings(max_examples=30)
@given(
    st.lists(
        st.tuples(
            st.text("abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=40),
            st.integers(0, 40_000),
        ),
        max_size=12,
    ),
    st.integers(0, 20_000),
)
def test_request_heads_around_the_cap(fuzz_server: GeserveProcess, headers: list[tuple[str, int]], path: int) -> None:
    """Within the cap a head is served, past it (as parsed) it gets 431; the server serves on either way."""
    url = "/v2/health/ready" + ("?" + "q" * path if path else "")
    lines = [f"x-{name}: {'v' * size}\r\n" for name, size in headers]
    head = f"GET {url} HTTP/1.1\r\nHost: fuzz\r\n{''.join(lines)}\r\n".encode()
    parsed = len(url) + len("host") + len("fuzz") + 4 + sum(len(line) - 2 for line in lines)
    with socket.create_connection(("127.0.0.1", fuzz_server.http_port), timeout=30) as sock:
        with contextlib.suppress(OSError):  # a 431 may come before all of the head is taken
            sock.sendall(head)
        answer = b""
        with contextlib.suppress(OSError):
            while b"\r\n\r\n" not in answer and (chunk := sock.recv(65536)):
                answer += chunk
    status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else None
    if len(head) <= HEADER_CAP:
        assert status == 200, answer[:300]
    elif parsed > HEADER_CAP:
        assert status == 431, answer[:300]
    else:
        assert status in (200, 431), answer[:300]  # the raw head is over, its parsed fields are not
    _good_request(fuzz_server)


@settings(max_examples=30)
@given(st.integers(0, 9000), st.sampled_from(["header", "version", "content-length"]))
def test_numbers_of_any_length(fuzz_server: GeserveProcess, digits: int, where: str) -> None:
    # Past 4300 digits Python's int() raises ValueError: every length must still be a clean answer.
    number = "1" + "0" * digits
    body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": [0] * 16}]})
    path, headers = "/v2/models/simple/infer", {"Inference-Header-Content-Length": number}
    if where == "version":
        path, headers = f"/v2/models/simple/versions/{number}/infer", {}
    elif where == "content-length":  # beyond any body: refused before it is read (a body of another length
        # than declared is a different matter: what follows it is taken for the next request)
        number = "1" + "0" * max(digits, 19)
        path, headers = "/v2/repository/models/simple/load", {"Content-Length": number}
    try:
        status, answer = _post(fuzz_server, path, body.encode(), headers)
    except (ConnectionError, http.client.HTTPException):  # the HTTP parser may close on a body that never comes
        status, answer = 400, b""
    _answered_cleanly(status, answer)
    _good_request(fuzz_server)


@settings(max_examples=20)
@given(st.integers(0, 3 << 20), st.integers(0, 3000))
def test_ids_and_parameters_of_any_size(fuzz_server: GeserveProcess, id_size: int, count: int) -> None:
    # Larger than a worker's pipe holds, within the limits or past them: a clean answer, and the model serves on.
    data = list(range(16))
    body = {
        "id": "i" * id_size,
        "parameters": {f"p{index}": "v" * 64 for index in range(count)},
        "inputs": [{"name": n, "datatype": "INT32", "shape": [1, 16], "data": data} for n in ("INPUT0", "INPUT1")],
    }
    status, answer = _post(fuzz_server, "/v2/models/simple/infer", json.dumps(body).encode())
    _answered_cleanly(status, answer)
    assert len(answer) < 2 * id_size + 4096
    _good_request(fuzz_server)
