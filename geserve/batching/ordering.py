"""Response order: answers leave in the order their requests were handed to an instance (preserve_ordering)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class ResponseOrder:
    """One instance's requests in the order they were dispatched to it: a request's answer waits until every
    request dispatched before it has been answered in full (its final response, for a decoupled model)."""

    def __init__(self) -> None:
        self._issued = 0
        self._head = 0  # the first request not yet answered in full
        self._finished: set[int] = set()
        self._due: dict[int, list[Callable[[], None]]] = {}
        self._advancing = False

    def issue(self) -> Turn:
        """The next request dispatched: its turn comes after every earlier one's."""
        turn = Turn(self, self._issued)
        self._issued += 1
        return turn

    def when_due(self, place: int, callback: Callable[[], None]) -> None:
        """Run `callback` once the request at `place` is the first not answered in full."""
        self._due.setdefault(place, []).append(callback)
        self._advance()

    def finish(self, place: int) -> None:
        """The request at `place` is answered in full."""
        self._finished.add(place)
        self._advance()

    def _advance(self) -> None:
        """Run what waits for the head's turn; move past the heads that are answered. Callbacks may finish
        turns themselves: the loop, not recursion, carries on."""
        if self._advancing:
            return
        self._advancing = True
        try:
            while True:
                callbacks = self._due.pop(self._head, None)
                if callbacks:
                    for callback in callbacks:
                        callback()
                    continue
                if self._head in self._finished:
                    self._finished.discard(self._head)
                    self._head += 1
                    continue
                return
        finally:
            self._advancing = False

    def due(self, place: int) -> bool:
        """Whether every request before `place` has been answered in full."""
        return place == self._head


class Turn:
    """A request's place in its instance's response order."""

    def __init__(self, order: ResponseOrder, place: int) -> None:
        self._order = order
        self.place = place
        self._finished = False

    def when_due(self, callback: Callable[[], None]) -> None:
        """Run `callback` once every earlier request has been answered in full (now, if they have)."""
        self._order.when_due(self.place, callback)

    async def wait(self) -> None:
        """Until every earlier request has been answered in full."""
        if self._finished or self._order.due(self.place):
            return
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def release() -> None:
            if not ready.done():  # else its reader went away
                ready.set_result(None)

        self.when_due(release)
        await ready

    def finish(self) -> None:
        """This request is answered in full (or abandoned): the next one's answers may leave. Idempotent."""
        if not self._finished:
            self._finished = True
            self._order.finish(self.place)
