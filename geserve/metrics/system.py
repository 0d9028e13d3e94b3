"""CPU utilization and memory of this machine, read from /proc for nv_cpu_* gauges."""

from __future__ import annotations

import time
from pathlib import Path


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies since boot, or None where /proc/stat is unavailable."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    values = [int(value) for value in fields]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return sum(values) - idle, sum(values)


def memory_bytes() -> tuple[int, int]:
    """(total, used) RAM in bytes; used = total - available, as Triton reports it."""
    info: dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            info[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return 0, 0
    total = info.get("MemTotal", 0)
    return total, total - info.get("MemAvailable", info.get("MemFree", 0))


class CpuUtilization:
    """Utilization over the last interval, refreshed at most once per interval."""

    def __init__(self, interval_ms: int) -> None:
        self._interval_s = interval_ms / 1000
        self._last = _cpu_times()
        self._last_at = time.monotonic()
        self._value = 0.0

    def value(self) -> float:
        now = time.monotonic()
        if now - self._last_at >= self._interval_s:
            current = _cpu_times()
            if current is not None and self._last is not None and current[1] > self._last[1]:
                self._value = (current[0] - self._last[0]) / (current[1] - self._last[1])
            self._last, self._last_at = current, now
        return self._value
