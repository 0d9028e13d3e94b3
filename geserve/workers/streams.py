"""ResponseStream: the responses of one request to a decoupled model, from its batch to its final one."""

from __future__ import annotations

import asyncio
import enum
from collections.abc import AsyncIterator, Callable

from geserve.errors import GeserveError
from geserve.residency import SharedTensor

# One response: its outputs (or None), its error (or None), and whether it is the stream's last.
StreamItem = tuple[dict[str, SharedTensor] | None, GeserveError | None, bool]


class StreamState(enum.Enum):
    OPEN = "open"  # the model may still answer
    ENDED = "ended"  # the final response (or an error) has arrived
    CANCELLED = "cancelled"  # the client went away; whatever the model still sends is dropped


class ResponseStream:
    """Lives on the event loop. The instance running the request puts responses in (`put`), a failure
    of the batch or of the instance ends it (`fail`), and the client reads it (`responses`). When the
    client goes away, `cancel` tells the instance through the callback it registered."""

    def __init__(self) -> None:
        self._items: asyncio.Queue[StreamItem] = asyncio.Queue()
        self.state = StreamState.OPEN
        self._on_cancel: Callable[[], None] | None = None

    @property
    def open(self) -> bool:
        return self.state is StreamState.OPEN

    def put(self, outputs: dict[str, SharedTensor] | None, error: GeserveError | None, final: bool) -> None:
        if self.state is not StreamState.OPEN:
            return
        if final:
            self.state = StreamState.ENDED
            self._on_cancel = None
        self._items.put_nowait((outputs, error, final))

    def fail(self, error: GeserveError) -> None:
        """End the stream with `error` (the batch or the instance failed); no-op once it has ended."""
        self.put(None, error, True)

    def on_cancel(self, callback: Callable[[], None]) -> None:
        """What the instance running the request does when the client goes away."""
        self._on_cancel = callback

    def cancel(self) -> None:
        if self.state is not StreamState.OPEN:
            return
        self.state = StreamState.CANCELLED
        callback, self._on_cancel = self._on_cancel, None
        if callback is not None:
            callback()

    async def responses(self) -> AsyncIterator[StreamItem]:
        """Every response until the final one."""
        while True:
            item = await self._items.get()
            yield item
            if item[2]:
                return
