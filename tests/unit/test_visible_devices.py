"""ASCEND_RT_VISIBLE_DEVICES as the runtime reads it: what it keeps, and the part it ignores."""

from __future__ import annotations

import pytest

from geserve.codecs.visible_devices import VisibleDevices, parse


@pytest.mark.parametrize(
    ("value", "kept", "dropped"),
    [
        ("0,1,3", ("0", "1", "3"), ""),
        ("1, 2,3", ("1",), " 2,3"),  # CANN's own example: the space before 2 ends the list
        (" 0", (), " 0"),
        ("0,1,", ("0", "1"), ""),  # a trailing comma: an empty last item, nothing lost
        ("2,1", ("2",), "1"),  # ids go in ascending order
        ("1,1", ("1",), "1"),
        ("0,x,3", ("0",), "x,3"),
        ("0,\u0663", ("0",), "\u0663"),  # not an ASCII digit
        ("", (), ""),
    ],
)
def test_the_list_ends_at_the_first_item_the_runtime_would_not_read(
    value: str, kept: tuple[str, ...], dropped: str
) -> None:
    assert parse(value) == VisibleDevices(kept, dropped)
