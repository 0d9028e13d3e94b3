"""Bounds on what one request carries besides its tensors: its id, its parameters, its sequence id."""

from __future__ import annotations

from geserve.errors import InvalidArgumentError
from geserve.types import Parameters

# Triton bounds none of these beyond its request size (--http-max-input-size, 64 MiB; gRPC: 2 GiB); they
# travel with every batch to the model's worker and back in errors and responses, so geserve bounds each
# well above any real use (a UUID is 36 bytes, a sequence id rarely more) and names the bound when refusing.
MAX_REQUEST_ID_BYTES = 8 << 10
MAX_SEQUENCE_ID_BYTES = 8 << 10
MAX_PARAMETERS = 1024
MAX_PARAMETER_BYTES = 1 << 20  # keys and string values of one request's parameters, together


def _utf8_size(text: str, limit: int) -> int:
    """The UTF-8 size of `text`, or its length when that alone is over `limit` (no large copy to learn so)."""
    if len(text) > limit:
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))


def check_request(request_id: str, parameters: Parameters) -> None:
    """Refuse a request whose id or parameters are over the bounds above, naming the bound."""
    if _utf8_size(request_id, MAX_REQUEST_ID_BYTES) > MAX_REQUEST_ID_BYTES:
        raise InvalidArgumentError(
            f"request id of {len(request_id)} characters exceeds the limit of {MAX_REQUEST_ID_BYTES} bytes"
        )
    if len(parameters) > MAX_PARAMETERS:
        raise InvalidArgumentError(
            f"request has {len(parameters)} parameters, more than the limit of {MAX_PARAMETERS} parameters"
        )
    sequence_id = parameters.get("sequence_id")
    if isinstance(sequence_id, str) and _utf8_size(sequence_id, MAX_SEQUENCE_ID_BYTES) > MAX_SEQUENCE_ID_BYTES:
        raise InvalidArgumentError(
            f"sequence id of {len(sequence_id)} characters exceeds the limit of {MAX_SEQUENCE_ID_BYTES} bytes"
        )
    size = 0
    for key, value in parameters.items():
        size += _utf8_size(key, MAX_PARAMETER_BYTES)
        if isinstance(value, str):
            size += _utf8_size(value, MAX_PARAMETER_BYTES)
        if size > MAX_PARAMETER_BYTES:
            raise InvalidArgumentError(
                f"request parameters exceed the limit of {MAX_PARAMETER_BYTES} bytes for their keys and string values"
            )
