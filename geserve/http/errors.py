"""Every HTTP error answer: a failure's status and Triton's `{"error": "<message>"}` body, built in one place."""

from __future__ import annotations

import http
import logging

import orjson
from starlette.exceptions import HTTPException
from starlette.responses import Response

from geserve.errors import ErrorCode, GeserveError, TooLargeError

logger = logging.getLogger(__name__)

HTTP_STATUS = {
    ErrorCode.INTERNAL: 500,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.UNSUPPORTED: 501,
    ErrorCode.UNKNOWN: 400,
    ErrorCode.INVALID_ARG: 400,
    ErrorCode.ALREADY_EXISTS: 400,
    ErrorCode.CANCELLED: 400,
}
JSON_CONTENT = (b"content-type", b"application/json")


def error_body(message: str) -> bytes:
    """Triton's error body: `{"error": "<message>"}`."""
    return orjson.dumps({"error": message})


def failure(error: Exception, serving: str) -> tuple[int, bytes]:
    """The status and body that answer a request which failed with `error`: Triton's status for its error
    code, the router's own for an unknown path or method, 500 (logged, with `serving` saying what) otherwise."""
    if isinstance(error, TooLargeError):
        return 413, error_body(error.message)
    if isinstance(error, GeserveError):
        return HTTP_STATUS.get(error.code, 400), error_body(error.message)
    if isinstance(error, HTTPException):
        return error.status_code, error_body(str(error.detail))
    logger.exception("unexpected error serving %s", serving)
    return 500, error_body(f"internal error: {type(error).__name__}: {error}")


def error_response(status: int, body: bytes) -> Response:
    """An error answer as a Starlette response."""
    return Response(body, status_code=status, media_type="application/json")


def raw_error_response(status: int, message: str, *extra: tuple[bytes, bytes]) -> bytes:
    """A whole HTTP/1.1 error response that closes its connection, for answers written below the ASGI app."""
    body = error_body(message)
    head = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n".encode()]
    headers = [JSON_CONTENT, (b"content-length", str(len(body)).encode()), *extra, (b"connection", b"close")]
    head += [name + b": " + value + b"\r\n" for name, value in headers]
    return b"".join([*head, b"\r\n", body])
