"""Bounds on a request's id, sequence id and parameters: at the bound served, past it refused naming it."""

from __future__ import annotations

import pytest

from geserve.core import limits
from geserve.errors import InvalidArgumentError


def test_values_at_the_bounds_pass() -> None:
    parameters: dict[str, str | int] = {f"k{index}": index for index in range(limits.MAX_PARAMETERS - 1)}
    parameters["sequence_id"] = "s" * limits.MAX_SEQUENCE_ID_BYTES
    limits.check_request("i" * limits.MAX_REQUEST_ID_BYTES, parameters)


def test_ids_are_measured_in_utf8_bytes() -> None:
    limits.check_request("π" * (limits.MAX_REQUEST_ID_BYTES // 2), {})
    with pytest.raises(
        InvalidArgumentError, match=f"request id of .* exceeds the limit of {limits.MAX_REQUEST_ID_BYTES} bytes"
    ):
        limits.check_request("π" * (limits.MAX_REQUEST_ID_BYTES // 2 + 1), {})


@pytest.mark.parametrize(
    ("request_id", "parameters", "match"),
    [
        ("i" * (limits.MAX_REQUEST_ID_BYTES + 1), {}, "request id of 8193 characters exceeds the limit of 8192 bytes"),
        ("", {f"k{index}": 0 for index in range(limits.MAX_PARAMETERS + 1)}, "more than the limit of 1024 parameters"),
        ("", {"sequence_id": "s" * 400_000}, "sequence id of 400000 characters exceeds the limit of 8192 bytes"),
        ("", {"a": "v" * limits.MAX_PARAMETER_BYTES}, "parameters exceed the limit of 1048576 bytes"),
        ("", {f"k{index}": "v" * 2048 for index in range(600)}, "parameters exceed the limit of 1048576 bytes"),
    ],
)
def test_past_a_bound_the_request_is_refused_naming_it(
    request_id: str, parameters: dict[str, object], match: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        limits.check_request(request_id, parameters)  # type: ignore[arg-type]
