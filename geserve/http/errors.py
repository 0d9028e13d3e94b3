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


def error_response(message: str, status: int) -> Response:
    return Response(orjson.dumps({"error": message}), status_code=status, media_type="application/json")


def from_error(error: GeserveError) -> Response:
    return error_response(error.message, HTTP_STATUS.get(error.code, 400))
