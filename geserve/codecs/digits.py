"""Whether text is a plain ASCII decimal number, the only kind of number a path, header or id may hold."""

from __future__ import annotations


def is_decimal(text: str) -> bool:
    """ASCII digits only: str.isdigit also takes '²' (which int() refuses) and '٣' (which int() reads as 3)."""
    return text.isascii() and text.isdigit()
