"""Which accelerator devices (Ascend NPUs) this server may place instances on."""

from __future__ import annotations

import os
import re
from pathlib import Path

_DEVICE_FILE = re.compile(r"^davinci(\d+)$")


def parse_device_ids(text: str) -> tuple[int, ...]:
    """`--device-ids 0,1,3` (an empty string means none)."""
    ids = [int(item) for item in text.split(",") if item.strip()]
    if any(device < 0 for device in ids):
        raise ValueError(f"device ids must be non-negative, got '{text}'")
    return tuple(sorted(set(ids)))


def discover_devices(dev: Path = Path("/dev")) -> tuple[int, ...]:
    """NPUs visible to this process: ASCEND_RT_VISIBLE_DEVICES when set, else the /dev/davinciN files."""
    visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
    if visible is not None:
        return parse_device_ids(visible)
    try:
        names = [entry.name for entry in dev.iterdir()]
    except OSError:
        return ()
    return tuple(sorted(int(m.group(1)) for name in names if (m := _DEVICE_FILE.match(name))))
