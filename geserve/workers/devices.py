"""Which NPUs this server may place instances on, as logical ids, and how a worker is shown its one NPU."""

from __future__ import annotations

import os
import re
from pathlib import Path

from geserve.codecs.digits import is_decimal

# /dev/davinciN are the physical chips mapped into this container; davinci_manager and friends are not chips.
_DEVICE_FILE = re.compile(r"^davinci(\d+)$")
VISIBLE_DEVICES = "ASCEND_RT_VISIBLE_DEVICES"


def parse_device_ids(text: str) -> tuple[int, ...]:
    """`--device-ids 0,1,3` (an empty string means none)."""
    ids = [int(item) for item in text.split(",") if item.strip()]
    if any(device < 0 for device in ids):
        raise ValueError(f"device ids must be non-negative, got '{text}'")
    return tuple(sorted(set(ids)))


def visible_entries(environ: dict[str, str] | None = None) -> list[str] | None:
    """ASCEND_RT_VISIBLE_DEVICES as the runtime reads it: ids up to the first one that is not a number."""
    value = (os.environ if environ is None else environ).get(VISIBLE_DEVICES)
    if value is None:
        return None
    entries = []
    for item in value.split(","):
        if not is_decimal(item.strip()):
            break
        entries.append(item.strip())
    return entries


def discover_devices(dev: Path = Path("/dev"), environ: dict[str, str] | None = None) -> tuple[int, ...]:
    """Logical NPU ids 0..n-1, as acl.rt.set_device takes them: n visible devices when
    ASCEND_RT_VISIBLE_DEVICES is set, else n /dev/davinciN chips (whatever their physical numbers)."""
    entries = visible_entries(environ)
    if entries is not None:
        return tuple(range(len(entries)))
    try:
        chips = [entry.name for entry in dev.iterdir() if _DEVICE_FILE.match(entry.name)]
    except OSError:
        return ()
    return tuple(range(len(chips)))


def worker_visible_devices(logical_id: int, environ: dict[str, str] | None = None) -> str:
    """The ASCEND_RT_VISIBLE_DEVICES a worker for `logical_id` gets, so that it sees that NPU alone
    (as its device 0). The variable takes ids of this process's view: a logical id, or the entry at
    that position when this process was itself restricted."""
    entries = visible_entries(environ)
    if entries is not None and logical_id < len(entries):
        return entries[logical_id]
    return str(logical_id)
