"""ASCEND_RT_VISIBLE_DEVICES read as the Ascend runtime reads it: the ids it keeps and the part it drops."""

from __future__ import annotations

from dataclasses import dataclass

from geserve.codecs.digits import is_decimal

VARIABLE = "ASCEND_RT_VISIBLE_DEVICES"


@dataclass(frozen=True, slots=True)
class VisibleDevices:
    """The entries the runtime keeps (as written), and the rest of the value, which it ignores."""

    kept: tuple[str, ...]
    dropped: str


def parse(value: str) -> VisibleDevices:
    """CANN's envref_07_0028: ids are separated by commas and may hold nothing else; at the first other
    character or invalid id the runtime reads only the ids before it ('1, 2,3' gives 1: the space before
    2 stops it). No space is stripped, then. The same page supports ids "only in ascending order" without
    saying what happens otherwise; we assume that an id not above the one before stops the list like an
    invalid id does (as the simulator does). An empty value keeps no id: nothing is visible. Whether an id
    names an existing device only the runtime can tell, so ids past the device count are kept here."""
    items = value.split(",")
    kept: list[str] = []
    for position, item in enumerate(items):
        if not is_decimal(item) or (kept and int(item) <= int(kept[-1])):
            return VisibleDevices(tuple(kept), ",".join(items[position:]))
        kept.append(item)
    return VisibleDevices(tuple(kept), "")
