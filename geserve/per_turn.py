"""PerTurn: ids let go on any thread, handed on together once per turn of an event loop."""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable


class PerTurn:
    """Collects ids from any thread (wherever the last reader of something let go) and hands them to `flush`
    together, once per turn of the event loop it is started on: one message for all of them, not one each."""

    def __init__(self, flush: Callable[[tuple[int, ...]], None]) -> None:
        self._flush = flush
        self._items: collections.deque[int] = collections.deque()  # appended on any thread, without a lock
        self._scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0

    def start(self) -> None:
        """From now on, on the running loop (ids added before are handed on with the first of its turns)."""
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()

    def add(self, item: int) -> None:
        self._items.append(item)
        if self._scheduled or self._loop is None:
            return
        self._scheduled = True
        try:
            if threading.get_ident() == self._loop_thread:
                self._loop.call_soon(self._hand_on)
            else:
                self._loop.call_soon_threadsafe(self._hand_on)
        except RuntimeError:  # the loop is closed: whoever held the ids forgets them with the connection
            pass

    def _hand_on(self) -> None:
        self._scheduled = False
        items: list[int] = []
        while self._items:
            items.append(self._items.popleft())
        if items:
            self._flush(tuple(items))
