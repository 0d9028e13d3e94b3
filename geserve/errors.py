"""The one error hierarchy of geserve; front-ends map ErrorCode to wire status codes."""

from __future__ import annotations

import enum


class ErrorCode(enum.Enum):
    """Triton's TRITONSERVER_Error codes, which decide HTTP status and gRPC code."""

    UNKNOWN = "UNKNOWN"
    INTERNAL = "INTERNAL"
    NOT_FOUND = "NOT_FOUND"
    INVALID_ARG = "INVALID_ARG"
    UNAVAILABLE = "UNAVAILABLE"
    UNSUPPORTED = "UNSUPPORTED"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    CANCELLED = "CANCELLED"


class GeserveError(Exception):
    """An error with a code a client can act on and a message that names what went wrong."""

    code: ErrorCode = ErrorCode.UNKNOWN

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def with_request_id(self, request_id: str) -> GeserveError:
        """The same error with Triton's `[request id: <id>] ` prefix, when the request has an id."""
        if not request_id:
            return self
        return type(self)(f"[request id: {request_id}] {self.message}")

    def __reduce__(self) -> tuple[type[GeserveError], tuple[str]]:
        return (type(self), (self.message,))


class InvalidArgumentError(GeserveError):
    code = ErrorCode.INVALID_ARG


class TooLargeError(InvalidArgumentError):
    """A request past one of the server's size limits: INVALID_ARG over gRPC, 413 over HTTP."""


class NotFoundError(GeserveError):
    code = ErrorCode.NOT_FOUND


class UnavailableError(GeserveError):
    code = ErrorCode.UNAVAILABLE


class UnsupportedError(GeserveError):
    code = ErrorCode.UNSUPPORTED


class DecoupledModelError(UnsupportedError):
    """A decoupled model was asked for one response; each front-end words the refusal as Triton does."""


class UnknownError(GeserveError):
    """TRITONSERVER_ERROR_UNKNOWN, which a model may answer with: 400 over HTTP, UNKNOWN over gRPC, as Triton."""

    code = ErrorCode.UNKNOWN


class InternalError(GeserveError):
    code = ErrorCode.INTERNAL


class AlreadyExistsError(GeserveError):
    code = ErrorCode.ALREADY_EXISTS


class CancelledError(GeserveError):
    code = ErrorCode.CANCELLED


class ModelLoadError(GeserveError):
    """A model (version) could not be loaded; the message says why."""

    code = ErrorCode.INTERNAL
