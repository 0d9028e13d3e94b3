"""LingeringIds: ids let go on any thread, handed on with the next message that leaves anyway, or after a linger."""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable

# How long released ids wait for a message to ride with. A request's outputs are released a moment after its
# answer; at one request at a time the next request (and its batch) follows within a few milliseconds, so the
# release rides on it instead of costing both processes a wakeup of its own. The price is the outputs' place in the
# worker's output arena, held this much longer when no traffic follows.
LINGER_S = 0.005


class LingeringIds:
    """Collects ids from any thread (wherever the last reader of something let go). The owner's next message takes
    them along (`take`, on the loop); ids no message took within `linger_s` are handed to `flush` together, in one
    message of their own."""

    def __init__(self, flush: Callable[[tuple[int, ...]], None], linger_s: float = LINGER_S) -> None:
        self._flush = flush
        self._linger_s = linger_s
        self._items: collections.deque[int] = collections.deque()  # appended on any thread, without a lock
        self._armed = False  # a hand-on is due (scheduled, or about to be from another thread)
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0

    def start(self) -> None:
        """From now on, on the running loop (ids added before are handed on with the first of its turns)."""
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()

    def add(self, item: int) -> None:
        self._items.append(item)
        if self._armed or self._loop is None:
            return
        self._armed = True
        try:
            if threading.get_ident() == self._loop_thread:
                self._arm()
            else:
                self._loop.call_soon_threadsafe(self._arm)
        except RuntimeError:  # the loop is closed: whoever held the ids forgets them with the connection
            pass

    def take(self) -> tuple[int, ...]:
        """The ids waiting, to go with a message leaving now (on the loop's thread). Their linger is called off, so an
        idle loop is not woken for nothing."""
        items = self._drain()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self._armed = False
            if self._items:  # added meanwhile on another thread, which saw the flag still set
                self._armed = True
                self._arm()
        return items

    def _drain(self) -> tuple[int, ...]:
        items: list[int] = []
        while self._items:
            items.append(self._items.popleft())
        return tuple(items)

    def _arm(self) -> None:
        assert self._loop is not None
        if self._timer is None:
            self._timer = self._loop.call_later(self._linger_s, self._hand_on)

    def _hand_on(self) -> None:
        self._timer = None
        self._armed = False
        items = self._drain()
        if items:
            self._flush(items)
