"""ClientWatch: tells a running infer request that its HTTP client went away, without polling the connection."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from geserve.http.body import ClientDisconnectedError

# The scope extension a connection puts its watch under, for the infer handler.
DISCONNECT_EXTENSION = "geserve.disconnect"

T = TypeVar("T")


class ClientWatch:
    """One per connection (its requests run one after the other): the connection calls `lost` when it is lost
    with a request unanswered; the infer handler awaits the core through `until_lost`, which that cancels."""

    __slots__ = ("_gone", "_task")

    def __init__(self) -> None:
        self._task: asyncio.Task[object] | None = None
        self._gone = False

    def lost(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            self._gone = True
            task.cancel()

    async def until_lost(self, awaitable: Awaitable[T]) -> T:
        """Await `awaitable` (the core's answer) in the handler's task; ClientDisconnectedError when the
        connection is lost meanwhile (the core sees its call cancelled, as a gRPC client's cancel does)."""
        task = asyncio.current_task()
        self._task, self._gone = task, False
        try:
            return await awaitable
        except asyncio.CancelledError:
            if self._gone and task is not None and task.uncancel() == 0:
                raise ClientDisconnectedError from None
            raise
        finally:
            self._task = None
