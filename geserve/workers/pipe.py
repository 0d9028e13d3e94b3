"""PipeEnd: the front-end's non-blocking end of a worker's pipe; every message travels whole, whatever its size."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import struct
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler

from geserve.errors import InvalidArgumentError

# multiprocessing.Connection's framing, which the worker's end (a plain blocking Connection) reads and writes:
# a signed 4-byte big-endian length, or -1 and an 8-byte length for messages of 2 GiB and more.
_LENGTH = struct.Struct("!i")
_LONG_LENGTH = struct.Struct("!Q")
# The largest control message either end sends. Requests are bounded well below it (geserve.core.limits), so
# only a model's own oversized answer meets it; it is refused before a byte is written, so the pipe stays whole.
MAX_MESSAGE_BYTES = 256 << 20
_READ_BYTES = 256 << 10


def too_large(size: int) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"a message of {size} bytes to or from the model's worker exceeds the worker channel's limit of "
        f"{MAX_MESSAGE_BYTES} bytes"
    )


def dumps(message: object) -> memoryview:
    """A message pickled as Connection.send pickles it; InvalidArgumentError when it is over the limit."""
    data = memoryview(ForkingPickler.dumps(message))
    if len(data) > MAX_MESSAGE_BYTES:
        raise too_large(len(data))
    return data


class PipeEnd:
    """Writes and reads whole messages on the event loop without ever blocking it. The descriptor is made
    non-blocking (uvloop's readers make it so anyway), so a write the pipe cannot take at once is kept and
    finished when the pipe drains, and a read that stops mid-message waits for the rest: a message is never
    left half written, which would leave the worker waiting forever for its end."""

    def __init__(
        self, connection: Connection, on_message: Callable[[object], None], on_lost: Callable[[], None]
    ) -> None:
        self._connection = connection
        self._fd = connection.fileno()
        self._on_message = on_message
        self._on_lost = on_lost
        self._loop = asyncio.get_running_loop()
        self._unsent = bytearray()  # the rest of messages the pipe could not take yet, in order
        self._received = bytearray()  # the start of a message still arriving
        self._open = True
        os.set_blocking(self._fd, False)
        self._loop.add_reader(self._fd, self._on_readable)

    @property
    def open(self) -> bool:
        return self._open

    @property
    def unsent(self) -> int:
        """Bytes accepted by `send` that the pipe has not taken yet."""
        return len(self._unsent)

    def send(self, message: object) -> None:
        """Queue one message whole: InvalidArgumentError (nothing sent) when it is over the limit, OSError
        when the pipe is closed or broken."""
        if not self._open:
            raise OSError("the worker's pipe is closed")
        data = dumps(message)
        frame = _LENGTH.pack(len(data)) + data  # one write for the whole frame, as the pipe allows
        if self._unsent:  # behind others: order is kept
            self._unsent += frame
            return
        try:
            written = os.write(self._fd, frame)
        except BlockingIOError:
            written = 0
        if written < len(frame):
            self._unsent += memoryview(frame)[written:]
            self._loop.add_writer(self._fd, self._on_writable)

    def close(self) -> None:
        """Stop reading and writing and close the connection; what was not sent yet is dropped."""
        if not self._open:
            return
        self._open = False
        for remove in (self._loop.remove_reader, self._loop.remove_writer):
            with contextlib.suppress(ValueError, OSError):  # the loop is closing
                remove(self._fd)
        self._unsent.clear()
        self._connection.close()

    def _on_writable(self) -> None:
        try:
            written = os.write(self._fd, self._unsent)
        except BlockingIOError:
            return
        except OSError:  # the worker is gone: its reader reports it
            self._loop.remove_writer(self._fd)
            self._unsent.clear()
            return
        del self._unsent[:written]
        if not self._unsent:
            self._loop.remove_writer(self._fd)

    def _on_readable(self) -> None:
        try:
            while True:
                chunk = os.read(self._fd, _READ_BYTES)
                if not chunk:
                    raise EOFError
                self._received += chunk
                if len(chunk) < _READ_BYTES:
                    break  # most likely drained: no extra read only to learn so
        except BlockingIOError:
            pass
        except (EOFError, OSError):
            self._lost()
            return
        self._deliver()

    def _deliver(self) -> None:
        received = self._received
        while self._open and len(received) >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(received)
            start = _LENGTH.size
            if size == -1:
                if len(received) < start + _LONG_LENGTH.size:
                    return
                (size,) = _LONG_LENGTH.unpack_from(received, start)
                start += _LONG_LENGTH.size
            if len(received) < start + size:
                return
            with memoryview(received) as view:
                message = pickle.loads(view[start : start + size])
            del received[: start + size]
            self._on_message(message)

    def _lost(self) -> None:
        self.close()
        self._on_lost()
