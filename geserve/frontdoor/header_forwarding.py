"""Request headers forwarded to the model as request parameters (--http-header-forward-pattern and its gRPC twin)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import replace

from geserve.errors import InvalidArgumentError
from geserve.types import InferRequest

# Parameters Triton sets itself (its common.h): a header of these names is refused, as is any `triton_` one.
RESERVED = frozenset(
    {"sequence_id", "sequence_start", "sequence_end", "priority", "timeout", "headers", "binary_data_output"}
)


def compile_pattern(pattern: str, flag: str) -> re.Pattern[str] | None:
    """The flag's pattern, matched as Triton matches it: anywhere in the header's name, ignoring case (Triton
    prefixes it with `(?i)`); None when the flag is not given. A pattern that does not compile names the flag."""
    if not pattern:
        return None
    try:
        return re.compile(pattern, re.IGNORECASE)
    except re.error as error:
        raise InvalidArgumentError(f"{flag}: '{pattern}' is not a regular expression: {error}") from None


def forwarded(pattern: re.Pattern[str] | None, headers: Iterable[tuple[str, str]]) -> dict[str, str]:
    """The headers whose names `pattern` matches, as string parameters named like the headers; a reserved name is
    refused with Triton's text."""
    found: dict[str, str] = {}
    if pattern is None:
        return found
    for key, value in headers:
        if pattern.search(key) is None:
            continue
        if key in RESERVED or key.startswith("triton_"):
            raise InvalidArgumentError(f"Header '{key}' is reserved for Triton usage and cannot be forwarded.")
        found[key] = value
    return found


def with_forwarded(
    request: InferRequest, pattern: re.Pattern[str] | None, headers: Iterable[tuple[str, str]]
) -> InferRequest:
    """The request with the headers `pattern` matches as string parameters, after its own, as Triton adds them."""
    found = forwarded(pattern, headers)
    return replace(request, parameters={**request.parameters, **found}) if found else request
