"""Whether text is a plain ASCII decimal number, the only kind of number a path, header or id may hold."""

from __future__ import annotations

# Python's int() refuses decimals of more than 4300 digits (sys.get_int_max_str_digits) with a ValueError; no
# length, count or version geserve reads has more than 19 (2**63 has 19), so longer ones are simply refused.
MAX_DECIMAL_DIGITS = 19


def is_decimal(text: str) -> bool:
    """ASCII digits only: str.isdigit also takes '²' (which int() refuses) and '٣' (which int() reads as 3)."""
    return text.isascii() and text.isdigit()


def decimal_value(text: str) -> int | None:
    """The value of a plain ASCII decimal of at most MAX_DECIMAL_DIGITS significant digits; None otherwise."""
    significant = text.lstrip("0")
    if not is_decimal(text) or len(significant) > MAX_DECIMAL_DIGITS:
        return None
    return int(significant or "0")  # int() counts leading zeros against its limit too


def decimal_over(text: str, limit: int) -> bool:
    """Whether `text` is a decimal larger than `limit`; one of more digits than any length has is."""
    if not is_decimal(text):
        return False
    value = decimal_value(text)
    return value is None or value > limit


def shortened(text: str, keep: int = 40) -> str:
    """`text` as an error message quotes it: a number of thousands of digits is not repeated whole."""
    return text if len(text) <= keep else f"{text[:keep]}..."
