"""Infer request bodies of known length read from the socket straight into one buffer, without copies."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol, cast

import numpy as np

from geserve.http.body import ClientDisconnectedError

# The ASGI scope extension under which an infer request's body is handed over when it is read directly.
BODY_EXTENSION = "geserve.direct_body"
# Bodies from this size are read directly: smaller ones usually come in the same read as their headers.
DIRECT_MIN_BYTES = 16 << 10
# What one read takes while no body is read directly (request heads, small or chunked bodies).
SCRATCH_BYTES = 64 << 10

# Which requests, by method and path, the app wants their bodies read directly; the app says, not the transport.
InPlaceBodies = Callable[[str, str], bool]
# Where a body read directly goes: a buffer of the given size (this process's memory unless the server says).
BodyAllocator = Callable[[int], memoryview]


def _nothing() -> None:
    pass


def heap_body(size: int) -> memoryview:
    return np.empty(size, dtype=np.uint8).data  # not zeroed: every byte is written by a read


class DirectBody:
    """One request body, filled by the socket reads in place; handed over whole once it is complete."""

    __slots__ = ("_abandoned", "_done", "_filled", "_on_read", "_view")

    def __init__(self, size: int, on_read: Callable[[], None], allocate: BodyAllocator = heap_body) -> None:
        self._view = allocate(size)
        self._filled = 0
        self._done = asyncio.Event()
        self._abandoned = False
        self._on_read = on_read  # what uvicorn's receive() does first (100 Continue, resume reading)

    def remaining(self) -> memoryview:
        """Where the next read goes."""
        return self._view[self._filled :]

    def received(self, nbytes: int) -> bool:
        """`nbytes` were read into `remaining()`; True once the body is complete."""
        self._filled += nbytes
        return self._filled >= len(self._view)

    def write(self, chunk: bytes) -> None:
        """A part the HTTP parser passed on (read together with the headers; the parser ends the message)."""
        end = min(self._filled + len(chunk), len(self._view))
        self._view[self._filled : end] = chunk[: end - self._filled]
        self._filled = end

    def complete(self) -> memoryview:
        self._done.set()
        return self._view

    def abandon(self) -> None:
        """The client went away (or was given up on) before the body was complete."""
        self._abandoned = True
        self._on_read = _nothing
        self._done.set()

    def release(self) -> None:
        """Its request was answered: let go of the connection. `on_read` refers to the connection, whose
        current request cycle's scope refers to this body; kept, that cycle would hold the whole body until the
        garbage collector's next full pass, which with bodies of megabytes comes long after gigabytes piled up."""
        self._on_read = _nothing

    async def read(self) -> memoryview:
        """The whole body, once it has arrived; ClientDisconnectedError if it never will."""
        on_read, self._on_read = self._on_read, _nothing  # needed once; kept, it would close a cycle
        on_read()
        await self._done.wait()
        if self._abandoned:
            raise ClientDisconnectedError
        return self._view


class DirectReading(Protocol):
    """The HTTP protocol as the reader sees it (connections.GuardedHttpProtocol)."""

    def direct_target(self) -> memoryview | None: ...

    def body_received(self, nbytes: int) -> None: ...

    def data_received(self, data: bytes) -> None: ...

    def connection_made(self, transport: asyncio.Transport) -> None: ...

    def connection_lost(self, exc: Exception | None) -> None: ...

    def eof_received(self) -> bool | None: ...

    def pause_writing(self) -> None: ...

    def resume_writing(self) -> None: ...


class BufferedReader(asyncio.BufferedProtocol):
    """What the event loop reads a connection into: a body being read directly gets the bytes in place,
    everything else goes through a scratch buffer to the HTTP parser, as plain reads would."""

    __slots__ = ("_http", "_into_body", "_scratch")

    def __init__(self, http: DirectReading) -> None:
        self._http = http
        self._scratch = memoryview(bytearray(SCRATCH_BYTES))
        self._into_body = False

    def get_buffer(self, sizehint: int) -> memoryview:
        target = self._http.direct_target()
        self._into_body = target is not None
        return target if target is not None else self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        if self._into_body:
            self._http.body_received(nbytes)
        else:
            self._http.data_received(self._scratch[:nbytes].tobytes())

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._http.connection_made(cast(asyncio.Transport, transport))

    def connection_lost(self, exc: Exception | None) -> None:
        self._http.connection_lost(exc)

    def eof_received(self) -> bool | None:
        return self._http.eof_received()

    def pause_writing(self) -> None:
        self._http.pause_writing()

    def resume_writing(self) -> None:
        self._http.resume_writing()
