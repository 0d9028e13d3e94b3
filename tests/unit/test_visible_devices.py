"""ASCEND_RT_VISIBLE_DEVICES as the runtime reads it: what it keeps, the part it ignores, and the lists it refuses."""

from __future__ import annotations

import pytest

from geserve.codecs.visible_devices import VisibleDevices, parse


@pytest.mark.parametrize(
    ("value", "kept", "dropped"),
    [
        ("0,1,3", ("0", "1", "3"), ""),
        ("1, 2,3", ("1",), " 2,3"),  # CANN's own example: the space before 2 ends the list
        ("0 ,1", ("0",), " ,1"),
        ("0,1 ", ("0", "1"), " "),  # a trailing space: nothing lost
        (" 0", (), " 0"),  # nothing is stripped: a value that does not start with a digit reads nothing
        ("0,1,", ("0", "1"), ""),  # a trailing comma: nothing lost
        ("0,,1", ("0",), ",1"),  # a second comma in a row ends the list
        ("0,x,3", ("0",), "x,3"),
        ("0x", ("0",), "x"),  # the digits before the other character are an id
        ("0,\u0663", ("0",), "\u0663"),  # not an ASCII digit
        ("0,2147483648,1", ("0",), "2147483648,1"),  # past INT_MAX: past every device
        ("", (), ""),
    ],
)
def test_the_list_ends_at_the_first_item_the_runtime_would_not_read(
    value: str, kept: tuple[str, ...], dropped: str
) -> None:
    assert parse(value) == VisibleDevices(kept, dropped)


@pytest.mark.parametrize(
    ("value", "refused"),
    [
        ("1,0", "an id is lower than the one before it ('0' after '1')"),
        ("0,2,1", "an id is lower than the one before it ('1' after '2')"),
        ("0,0", "an id is listed twice ('0')"),
        ("1,2,2", "an id is listed twice ('2')"),
        ("1,2,1", "an id is lower than the one before it ('1' after '2')"),  # the runtime checks the order first
        ("1,01", "an id is listed twice ('01')"),
    ],
)
def test_a_descending_or_repeated_id_makes_the_runtime_refuse_the_whole_list(value: str, refused: str) -> None:
    assert parse(value) == VisibleDevices((), "", refused)


@pytest.mark.parametrize(
    ("value", "count", "expected"),
    [
        ("0,5", 2, VisibleDevices(("0",), "5")),  # 5 is past the two devices: the list ends there
        ("5", 2, VisibleDevices((), "5")),
        ("0,5,1", 2, VisibleDevices(("0",), "5,1")),  # the runtime stops at 5 before it sees 1 come down
        ("0,1,1", 2, VisibleDevices(("0", "1"), "1")),  # it stops once it holds as many ids as there are devices
        ("1,0", 2, VisibleDevices((), "", "an id is lower than the one before it ('0' after '1')")),
        ("1,0", 1, VisibleDevices((), "1,0")),
        ("0,1", 0, VisibleDevices((), "0,1")),
    ],
)
def test_with_the_device_count_ids_past_it_end_the_list(value: str, count: int, expected: VisibleDevices) -> None:
    assert parse(value, count) == expected
