"""Time for schedulers: the event loop's monotonic clock, replaceable by a manual one in tests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    """Monotonic nanoseconds (comparable across processes on Linux) and one-shot timers."""

    def now_ns(self) -> int: ...

    def call_at(self, when_ns: int, callback: Callable[[], None]) -> Timer: ...


class LoopClock:
    """time.monotonic_ns() with timers on the running event loop."""

    def now_ns(self) -> int:
        return time.monotonic_ns()

    def call_at(self, when_ns: int, callback: Callable[[], None]) -> Timer:
        delay_s = max(when_ns - time.monotonic_ns(), 0) / 1e9
        return asyncio.get_running_loop().call_later(delay_s, callback)
