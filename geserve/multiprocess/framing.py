"""Frames of the engine channel: the messages of one turn of the loop, pickled together; large buffers beside them."""

# A frame is `<Q body length>` then the body: `<I pickle length><I buffer count>`, one `<Q length>` per buffer, the
# pickle (a list of messages), then the buffers. One pickle a turn: the classes its messages name are looked up once,
# not once a message. Buffers of `INLINE_BYTES` or more are written with the frame in one `writelines` and read into
# one allocation that the unpickled arrays then view.

from __future__ import annotations

import asyncio
import pickle
import struct
from collections.abc import Callable
from typing import Any

_FRAME = struct.Struct("<Q")
_BODY = struct.Struct("<II")
_LENGTH = struct.Struct("<Q")
INLINE_BYTES = 16 << 10  # smaller buffers are copied into the pickle: one write element beats several
_READ_CHUNK = 256 << 10


def encode(message: Any) -> list[bytes | memoryview]:
    """The parts of one frame, in order; the buffers are the message's own memory, not copies."""
    buffers: list[memoryview] = []

    def out_of_band(buffer: pickle.PickleBuffer) -> bool:
        view = buffer.raw()
        if view.nbytes < INLINE_BYTES:
            return True  # in band
        buffers.append(view)
        return False

    data = pickle.dumps(message, protocol=5, buffer_callback=out_of_band)
    lengths = b"".join(_LENGTH.pack(view.nbytes) for view in buffers)
    body = _BODY.size + len(lengths) + len(data) + sum(view.nbytes for view in buffers)
    return [_FRAME.pack(body) + _BODY.pack(len(data), len(buffers)) + lengths, data, *buffers]


def decode(body: memoryview) -> Any:
    """The message of one frame's body; its out-of-band arrays view `body`."""
    size, count = _BODY.unpack_from(body)
    position = _BODY.size
    lengths = [_LENGTH.unpack_from(body, position + index * _LENGTH.size)[0] for index in range(count)]
    position += count * _LENGTH.size
    data = body[position : position + size]
    position += size
    buffers = []
    for length in lengths:
        buffers.append(body[position : position + length])
        position += length
    return pickle.loads(data, buffers=buffers)


class FrameProtocol(asyncio.BufferedProtocol):
    """Reads frames off a stream straight into their buffers and hands each decoded message to `on_message`;
    writes are gathered for one turn of the loop and sent in one `writelines` (small messages coalesce)."""

    def __init__(
        self,
        on_message: Callable[[Any], None],
        on_lost: Callable[[Exception | None], None],
        on_made: Callable[[], None] | None = None,
        on_unsendable: Callable[[Any, Exception], None] | None = None,
        riders: Callable[[], list[Any]] | None = None,
    ) -> None:
        self._on_message = on_message
        self._riders = riders  # messages that wait for a frame leaving anyway, asked for as each frame leaves
        self._on_lost = on_lost
        self._on_made = on_made
        self._on_unsendable = on_unsendable  # a message that cannot be pickled, and why (it is not sent)
        self.transport: asyncio.Transport | None = None
        self._chunk = bytearray(_READ_CHUNK)  # small frames, and the start of large ones
        self._filled = 0
        self._large: bytearray | None = None  # the body of a frame larger than a chunk, being filled
        self._large_filled = 0
        self._pending: list[Any] = []  # messages of this turn
        self._flush_scheduled = False
        self._paused = False
        self._resumed: asyncio.Event | None = None

    # -- writing ---------------------------------------------------------------------------

    def send(self, message: Any) -> None:
        """Queue a message; it leaves with the others of this turn of the loop, in one frame."""
        if self.transport is None or self.transport.is_closing():
            return
        self._pending.append(message)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        messages, self._pending = self._pending, []
        if not messages or self.transport is None or self.transport.is_closing():
            return
        if self._riders is not None:
            messages += self._riders()
        try:
            parts = encode(messages)
        except Exception:  # one of them cannot be pickled: the others still go, one frame each
            parts = self._encode_each(messages)
        if parts:
            self.transport.writelines(parts)

    def _encode_each(self, messages: list[Any]) -> list[bytes | memoryview]:
        parts: list[bytes | memoryview] = []
        for message in messages:
            try:
                parts += encode([message])
            except Exception as error:
                if self._on_unsendable is None:
                    raise
                self._on_unsendable(message, error)
        return parts

    async def drained(self) -> None:
        """Wait while the peer is not reading (the transport's buffer is over its high-water mark)."""
        if self._paused:
            if self._resumed is None:
                self._resumed = asyncio.Event()
            await self._resumed.wait()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._resumed is not None:
            self._resumed.set()
            self._resumed = None

    # -- reading ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if self._on_made is not None:
            self._on_made()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.resume_writing()
        self._on_lost(exc)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._large is not None:
            return memoryview(self._large)[self._large_filled :]
        return memoryview(self._chunk)[self._filled :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._large is not None:
            self._large_filled += nbytes
            if self._large_filled == len(self._large):
                body, self._large = self._large, None
                self._deliver(decode(memoryview(body)))
            return
        self._filled += nbytes
        self._take_frames()

    def _deliver(self, messages: list[Any]) -> None:
        for message in messages:
            self._on_message(message)

    def _take_frames(self) -> None:
        chunk = memoryview(self._chunk)
        position = 0
        while self._filled - position >= _FRAME.size:
            (length,) = _FRAME.unpack_from(chunk, position)
            start = position + _FRAME.size
            available = self._filled - start
            if available >= length:
                # A small frame: decoded from a copy, since the chunk is reused; a large one would have gone
                # to its own buffer below.
                body = memoryview(bytes(chunk[start : start + length])) if length < INLINE_BYTES else None
                if body is None:
                    body = memoryview(bytearray(chunk[start : start + length]))
                position = start + length
                self._deliver(decode(body))
                continue
            if length > len(self._chunk) - _FRAME.size:
                # Larger than a chunk: read the rest of it straight into its own buffer.
                large = bytearray(length)
                large[:available] = chunk[start : self._filled]
                self._large, self._large_filled = large, available
                position = self._filled
            break
        if position:
            remaining = self._filled - position
            chunk[:remaining] = chunk[position : self._filled]
            self._filled = remaining
        chunk.release()
