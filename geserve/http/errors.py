"""ErrorCode -> HTTP status, and Triton's `{"error": "<message>"}` bodies."""

from __future__ import annotations

import orjson
from starlette.responses import Response

from geserve.errors import ErrorCode, GeserveError

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


def error_body(message: str) -> bytes:
    """Triton's error body: `{"error": "<message>"}`."""
    return orjson.dumps({"error": message})


def status_of(error: GeserveError) -> int:
    return HTTP_STATUS.get(error.code, 400)


def unexpected_message(error: Exception) -> str:
    """The text of a 500 for an exception no layer anticipated."""
    return f"internal error: {type(error).__name__}: {error}"


def error_response(message: str, status: int) -> Response:
    return Response(error_body(message), status_code=status, media_type="application/json")


def from_error(error: GeserveError) -> Response:
    return error_response(error.message, status_of(error))
