"""The HTTP front-end's one error mapping, and the app's choice of bodies the connection reads in place."""

from __future__ import annotations

import logging

import orjson
import pytest
from starlette.exceptions import HTTPException

from geserve.errors import InvalidArgumentError, NotFoundError, UnavailableError, UnsupportedError
from geserve.http.app import HttpApp
from geserve.http.connections import protocol_class
from geserve.http.errors import failure, raw_error_response
from geserve.settings import HttpSettings


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (InvalidArgumentError("bad input"), 400),
        (NotFoundError("no such region"), 404),
        (UnavailableError("not ready"), 503),
        (UnsupportedError("no cuda"), 501),
    ],
)
def test_geserve_errors_answer_triton_statuses_with_their_message(error: Exception, status: int) -> None:
    assert failure(error, "a test") == (status, orjson.dumps({"error": str(error)}))


def test_router_errors_keep_their_status_and_detail() -> None:
    assert failure(HTTPException(405), "a test") == (405, b'{"error":"Method Not Allowed"}')
    assert failure(HTTPException(404, "Not Found"), "a test") == (404, b'{"error":"Not Found"}')


def test_unexpected_errors_are_500s_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="geserve.http.errors"):
        try:
            raise KeyError("lost")
        except KeyError as error:
            status, body = failure(error, "GET /v2/x")
    assert (status, body) == (500, b'{"error":"internal error: KeyError: \'lost\'"}')
    assert "unexpected error serving GET /v2/x" in caplog.text and "KeyError" in caplog.text


def test_raw_error_responses_are_whole_and_close_the_connection() -> None:
    response = raw_error_response(503, "full", (b"retry-after", b"1"))
    head, _, body = response.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 503 Service Unavailable"
    assert set(lines[1:]) == {
        b"content-type: application/json",
        f"content-length: {len(body)}".encode(),
        b"retry-after: 1",
        b"connection: close",
    }
    assert body == b'{"error":"full"}'


@pytest.mark.parametrize(
    ("method", "path", "in_place"),
    [
        ("POST", "/v2/models/m/infer", True),
        ("POST", "/v2/models/m/versions/3/infer", True),
        ("GET", "/v2/models/m/infer", False),
        ("POST", "/v2/models/m/versions/x/infer", False),
        ("POST", "/v2/repository/index", False),
        ("POST", "/v2/models/m/infer/", False),
    ],
)
def test_only_infer_posts_are_read_in_place(method: str, path: str, in_place: bool) -> None:
    assert HttpApp.reads_body_in_place(method, path) is in_place


def test_each_listener_reads_in_place_only_what_it_was_told() -> None:
    def told(method: str, path: str) -> bool:
        return path == "/big"

    http = protocol_class("HTTPService", HttpSettings(), told)
    assert http.reads_in_place("POST", "/big") and not http.reads_in_place("POST", "/small")
    assert not protocol_class("Metrics Service", HttpSettings()).reads_in_place("POST", "/big")
