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


class Alarm:
    """A scheduler's one wake-up: set it to when it must look again (None: no need), moving the timer only
    when that changes."""

    def __init__(self, clock: Clock, callback: Callable[[], None]) -> None:
        self._clock = clock
        self._callback = callback
        self._timer: Timer | None = None
        self._at: int | None = None

    def set(self, when_ns: int | None) -> None:
        if when_ns == self._at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._at = None, when_ns
        if when_ns is not None:
            self._timer = self._clock.call_at(when_ns, self._ring)

    def _ring(self) -> None:
        self._timer, self._at = None, None
        self._callback()
