"""The control line between the supervisor and each process it starts: the launch, then one word at a time."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import mmap
import socket
from dataclasses import dataclass

from geserve.lifecycle import Role
from geserve.settings import Settings
from geserve.workers.runs import RunId

# Supervisor -> process.
DRAIN = b"drain"  # report not ready (engine); serve the drain window, then stop accepting and finish (protocol)
REFUSE = b"refuse"  # the drain window is over: admit no new request, finish those admitted (engine)
STOP = b"stop"  # every protocol process has exited: stop the workers and exit (engine)
KILL = b"kill"  # a second signal: exit now
PING = b"ping"  # answer PONG from the event loop (protocol): a loop that does not answer is stuck
# Process -> supervisor.
READY = b"ready"
PONG = b"pong"


@dataclass(frozen=True, slots=True)
class Launch:
    """What a process of the layout is started with; sockets are descriptors it inherited."""

    role: Role
    settings: Settings
    run: RunId
    channel_path: str  # the engine's unix socket
    index: int = 0  # a protocol process's number
    http_fd: int = -1  # protocol processes: the HTTP socket the supervisor bound
    metrics_fd: int = -1  # the engine: the metrics socket the supervisor bound
    connection_counts: mmap.mmap | None = None  # protocol processes: their open HTTP connections, shared
    arena: str = ""  # a protocol process: the name of its request arena's segment


def send_word(control: socket.socket, word: bytes) -> None:
    """Supervisor side (blocking socket); a process that is gone is not an error."""
    with contextlib.suppress(OSError):
        control.sendall(word + b"\n")


class ControlLine:
    """A process's end of its control line, on its event loop."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._kept: collections.deque[bytes] = collections.deque()  # read by a listener they were not for

    @classmethod
    async def open(cls, control: socket.socket) -> ControlLine:
        reader, writer = await asyncio.open_unix_connection(sock=control)
        return cls(reader, writer)

    async def next_word(self) -> bytes:
        """The next word from the supervisor (one kept back first); b"" when it is gone (its end closed)."""
        if self._kept:
            return self._kept.popleft()
        return await self.read_word()

    async def read_word(self) -> bytes:
        """The next word off the line itself, past any kept back: for a listener that keeps what is not its own."""
        try:
            line = await self._reader.readline()
        except (ConnectionError, OSError):
            return b""
        return line.strip()

    def keep(self, word: bytes) -> None:
        """A word read by a listener it was not for: `next_word` gives it to the next reader."""
        self._kept.append(word)

    def tell(self, word: bytes) -> None:
        if not self._writer.is_closing():
            self._writer.write(word + b"\n")
