"""ASCEND_RT_VISIBLE_DEVICES read as the Ascend runtime reads it: the ids it keeps, the rest it drops, or a refusal."""

from __future__ import annotations

import re
from dataclasses import dataclass

VARIABLE = "ASCEND_RT_VISIBLE_DEVICES"

# What the runtime reads of the value (hicann/runtime src/runtime/core/src/runtime.cc SplitString): runs of ASCII
# digits separated by single commas, from the first character on. Anything else ends it, a space included ('1, 2,3'
# reads 1, as CANN's envref_07_0028 says); so does a second comma in a row; a value that does not start with a digit
# reads nothing. Nothing is stripped.
_READ = re.compile(r"[0-9]+(?:,[0-9]+)*,?")
_ID = re.compile(r"[0-9]+")
# std::stoi fails past INT_MAX, and the runtime then takes the id as past every device (Runtime::GetVisibleDevices).
_INT_MAX = (1 << 31) - 1


@dataclass(frozen=True, slots=True)
class VisibleDevices:
    """The ids the runtime keeps (as written) and the rest of the value, which it ignores; or, where it refuses the
    list whole and so sees no device at all, why (`refused`)."""

    kept: tuple[str, ...]
    dropped: str
    refused: str = ""


def parse(value: str, device_count: int | None = None) -> VisibleDevices:
    """As Runtime::GetVisibleDevices (hicann/runtime runtime.cc) takes the ids it read: it stops at the first id past
    the devices there are (`device_count`) and once it holds that many, keeping the ids before; but an id lower than
    the one before it, or one listed before, makes it refuse the whole list (RT_ALL_ORDER_ERROR,
    RT_ALL_DUPLICATED_ERROR): no device is visible then. Without `device_count` only ids past INT_MAX are known to be
    past the devices, so a list that comes down after an id the runtime would have stopped at ('0,5,1' on two
    devices) is taken as refused. An empty value keeps no id: nothing is visible."""
    read = _READ.match(value)
    ids = list(_ID.finditer(read.group())) if read else []
    rest = value[read.end() :] if read else value
    kept: list[str] = []
    for position, match in enumerate(ids):
        number = int(match.group())
        if number > _INT_MAX or (device_count is not None and number >= device_count):
            return VisibleDevices(tuple(kept), value[match.start() :])
        if kept and number < int(kept[-1]):
            return VisibleDevices(
                (), "", f"an id is lower than the one before it ('{match.group()}' after '{kept[-1]}')"
            )
        if any(int(earlier) == number for earlier in kept):
            return VisibleDevices((), "", f"an id is listed twice ('{match.group()}')")
        kept.append(match.group())
        if device_count is not None and len(kept) >= device_count and position + 1 < len(ids):
            return VisibleDevices(tuple(kept), value[ids[position + 1].start() :])
    return VisibleDevices(tuple(kept), rest)
