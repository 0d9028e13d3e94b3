"""Decimal numbers as paths and headers carry them: ASCII digits only, and no more than any length or version has."""

from __future__ import annotations

import pytest

from geserve.codecs.digits import MAX_DECIMAL_DIGITS, decimal_over, decimal_value


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("0", 0),
        ("007", 7),
        ("9" * MAX_DECIMAL_DIGITS, int("9" * MAX_DECIMAL_DIGITS)),
        ("0" * 6000 + "42", 42),  # leading zeros are not significant
        ("1" + "0" * MAX_DECIMAL_DIGITS, None),
        ("9" * 5000, None),  # int() would raise ValueError past 4300 digits
        ("", None),
        ("-1", None),
        ("٣", None),
        ("1 ", None),
    ],
)
def test_decimal_value(text: str, value: int | None) -> None:
    assert decimal_value(text) == value


@pytest.mark.parametrize(
    ("text", "over"),
    [
        ("100", False),
        ("101", True),
        ("1" + "0" * 19, True),
        ("9" * 5000, True),
        ("0" * 5000 + "5", False),
        ("x", False),
    ],
)
def test_decimal_over_a_limit_of_100(text: str, over: bool) -> None:
    # A length of more digits than any length has is over every limit, though its value is not read.
    assert decimal_over(text, 100) is over
