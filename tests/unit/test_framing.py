"""Frames of the engine channel: encoded and decoded whole, read off a stream however it is split, sent coalesced.

On the wire a frame carries the messages of one turn of the sender's loop as one pickled list; the reader hands
them out one by one, in order."""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import Iterable
from typing import Any

import numpy as np
import pytest

from geserve.multiprocess import framing
from geserve.multiprocess.framing import INLINE_BYTES, FrameProtocol, decode, encode
from geserve.types import InferInput, InferRequest

CHUNK = 256 << 10  # FrameProtocol's read chunk
HEADER = 8  # the <Q body length> before every body


def _frame(message: Any) -> bytes:
    return b"".join(bytes(part) for part in encode(message))


def _turn(messages: list[Any]) -> bytes:
    """The frame one turn of the sender's loop writes: its messages in one pickled list."""
    return _frame(list(messages))


def _body(message: Any) -> memoryview:
    return memoryview(bytearray(_frame(message)[HEADER:]))


def _address(array: np.ndarray | bytes | memoryview) -> int:
    return int(np.frombuffer(array, dtype=np.uint8).__array_interface__["data"][0])


def _assert_same(received: Any, sent: Any) -> None:
    """Equal messages, arrays compared by value (== on arrays is elementwise)."""
    if isinstance(sent, np.ndarray):
        assert isinstance(received, np.ndarray) and received.dtype == sent.dtype
        np.testing.assert_array_equal(received, sent)
    elif isinstance(sent, (tuple, list)):
        assert type(received) is type(sent) and len(received) == len(sent)
        for left, right in zip(received, sent, strict=True):
            _assert_same(left, right)
    elif isinstance(sent, dict):
        assert received.keys() == sent.keys()
        for key in sent:
            _assert_same(received[key], sent[key])
    else:
        assert received == sent


# -- encode and decode ---------------------------------------------------------------------


def test_a_small_message_is_one_header_and_its_pickle() -> None:
    message = (3, 17, "infer", {"values": np.arange(8, dtype=np.int32)})
    parts = encode(message)
    assert len(parts) == 2  # no out-of-band buffer: the small array went into the pickle
    assert int.from_bytes(parts[0][:HEADER], "little") == sum(len(part) for part in parts) - HEADER
    _assert_same(decode(memoryview(_frame(message))[HEADER:]), message)


def test_large_arrays_travel_beside_the_pickle_as_their_own_memory() -> None:
    first = np.arange(INLINE_BYTES // 4, dtype=np.float32)  # exactly INLINE_BYTES: out of band
    second = np.arange(1 << 18, dtype=np.int64).reshape(512, 512)
    small = np.arange(INLINE_BYTES // 8 - 1, dtype=np.int64)  # one element under: in band
    message = (5, 1, {"first": first, "second": second, "small": small})
    parts = encode(message)
    assert len(parts) == 4  # header, pickle, then the two large arrays in the order they were pickled
    buffers = parts[2:]
    assert [part.nbytes for part in buffers if isinstance(part, memoryview)] == [first.nbytes, second.nbytes]
    # Not copies: the parts are the arrays' own memory, written to the socket as they are.
    assert _address(buffers[0]) == _address(first) and _address(buffers[1]) == _address(second)
    assert len(parts[1]) < small.nbytes + 1024  # the pickle holds the small array only
    assert int.from_bytes(parts[0][:HEADER], "little") == sum(len(part) for part in parts) - HEADER


def test_decoded_large_arrays_view_the_body_and_small_ones_are_equal() -> None:
    large = np.random.default_rng(1).standard_normal((300, 100)).astype(np.float32)
    small = np.arange(5, dtype=np.uint8)
    message = {"large": large, "small": small, "text": "hé", "nothing": None}
    body = _body(message)
    decoded = decode(body)
    _assert_same(decoded, message)
    whole = np.frombuffer(body, dtype=np.uint8)
    assert np.shares_memory(decoded["large"], whole)  # viewed in place, not copied out of the body
    assert decoded["large"].shape == (300, 100)


def test_memoryview_tensors_cross_out_of_band_and_come_back_as_bytes() -> None:
    data = bytearray(range(256)) * 256  # 64 KiB of raw tensor bytes, as a binary HTTP body gives them
    tensor = InferInput("INPUT0", "UINT8", (len(data),), memoryview(data))
    request = InferRequest("echo", "", (tensor,), raw_body=memoryview(data))
    parts = encode((0, 9, "infer", (request, ())))
    assert [part.nbytes for part in parts[2:] if isinstance(part, memoryview)] == [len(data), len(data)]
    assert all(_address(part) == _address(memoryview(data)) for part in parts[2:])
    body = memoryview(bytearray(b"".join(bytes(part) for part in parts)[HEADER:]))
    decoded = decode(body)[3][0]
    assert bytes(decoded.inputs[0].data) == bytes(data) and bytes(decoded.raw_body) == bytes(data)
    assert np.shares_memory(np.frombuffer(decoded.inputs[0].data, np.uint8), np.frombuffer(body, np.uint8))


# -- reading a stream ----------------------------------------------------------------------


class Reader:
    """A FrameProtocol fed as a transport feeds it: into the buffer it offers, never more than that."""

    def __init__(self) -> None:
        self.messages: list[Any] = []
        self.lost: list[Exception | None] = []
        self.protocol = FrameProtocol(self.messages.append, self.lost.append)

    def feed(self, data: bytes, step: int) -> None:
        """`data` in reads of at most `step` bytes."""
        position = 0
        while position < len(data):
            buffer = self.protocol.get_buffer(-1)
            assert len(buffer) > 0, "an empty buffer stops the transport"
            count = min(len(buffer), step, len(data) - position)
            buffer[:count] = data[position : position + count]
            self.protocol.buffer_updated(count)
            position += count

    def feed_parts(self, pieces: Iterable[bytes]) -> None:
        for piece in pieces:
            self.feed(piece, len(piece))


def _stream(messages: list[Any]) -> bytes:
    """One frame per message, as when each was the only send of its turn."""
    return b"".join(_turn([message]) for message in messages)


def _bytes_message(frame_size: int) -> bytes:
    """A bytes payload whose frame (sent alone in its turn) is exactly `frame_size` bytes."""
    payload = b"x" * frame_size
    while len(_turn([payload])) > frame_size:
        payload = payload[: len(payload) - (len(_turn([payload])) - frame_size)]
    assert len(_turn([payload])) == frame_size
    return payload


SMALL = [(3, 1, "live"), (3, 2, True), {"k": np.arange(6, dtype=np.int16)}, "", (6, 3)]


def test_small_frames_split_at_every_boundary_come_out_once_in_order() -> None:
    data = _stream(SMALL)
    for split in range(len(data) + 1):
        reader = Reader()
        reader.feed_parts([data[:split], data[split:]])
        assert len(reader.messages) == len(SMALL), f"split at {split}"
        _assert_same(reader.messages, SMALL)


def test_frames_of_several_messages_split_at_every_boundary_come_out_once_in_order() -> None:
    # Turns of two, one and two sends: each frame's list is handed out message by message.
    data = _turn(SMALL[:2]) + _turn(SMALL[2:3]) + _turn(SMALL[3:])
    for split in range(len(data) + 1):
        reader = Reader()
        reader.feed_parts([data[:split], data[split:]])
        assert len(reader.messages) == len(SMALL), f"split at {split}"
        _assert_same(reader.messages, SMALL)


def test_small_frames_fed_one_byte_at_a_time() -> None:
    data = _stream(SMALL * 3)
    reader = Reader()
    reader.feed(data, 1)
    _assert_same(reader.messages, SMALL * 3)


def test_several_frames_in_one_read() -> None:
    messages = [(3, index, np.full(100, index, np.int32)) for index in range(200)]
    reader = Reader()
    reader.feed(_stream(messages), CHUNK)
    _assert_same(reader.messages, messages)


@pytest.mark.parametrize("frame_size", [CHUNK - 1, CHUNK, CHUNK + 1])
@pytest.mark.parametrize("after", [0, 1, 100])
def test_frames_around_the_chunk_size_wherever_they_start(frame_size: int, after: int) -> None:
    # Each starts mid-chunk (after `after` bytes of small frames), so the reader shifts or grows for it.
    lead = (1, "lead") if after else None
    big = _bytes_message(frame_size)
    messages = [*([lead] * after), big, (2, "tail"), big, big]
    data = _stream(messages)
    for step in (CHUNK, 4096, 65537, len(data)):
        reader = Reader()
        reader.feed(data, step)
        assert len(reader.messages) == len(messages), f"step {step}"
        _assert_same(reader.messages, messages)


def test_a_frame_just_over_the_chunk_fed_one_byte_at_a_time() -> None:
    messages = [(1, "before"), _bytes_message(CHUNK + 9), (2, "after")]
    reader = Reader()
    reader.feed(_stream(messages), 1)
    _assert_same(reader.messages, messages)


def test_frames_larger_than_a_chunk_arrive_whole_and_viewed_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    bodies: list[memoryview] = []

    def recording(body: memoryview) -> Any:
        bodies.append(body)
        return decode(body)

    monkeypatch.setattr(framing, "decode", recording)
    rng = np.random.default_rng(7)
    arrays = [rng.integers(0, 1 << 30, size, dtype=np.int64) for size in (1 << 15, 1 << 17, 3 << 16)]
    messages = [(5, 1, arrays[0]), (3, 2, "small"), (5, 3, arrays[1]), (5, 4, (arrays[2], arrays[0]))]
    data = _stream(messages)
    assert len(_turn([messages[2]])) > CHUNK
    for step in (1 << 20, CHUNK, 100_000, 8191, len(data)):
        bodies.clear()
        reader = Reader()
        reader.feed(data, step)
        _assert_same(reader.messages, messages)
        # Each large array views the body its frame was read into: no copy after the read (one frame a message).
        for message, body in zip(reader.messages, bodies, strict=True):
            if isinstance(message[2], np.ndarray):
                assert np.shares_memory(message[2], np.frombuffer(body, np.uint8))
        # A body that outlives its read is not overwritten by the next frames.
        np.testing.assert_array_equal(reader.messages[0][2], arrays[0])


def test_connection_lost_is_reported() -> None:
    reader = Reader()
    error = ConnectionResetError("gone")
    reader.protocol.connection_lost(error)
    assert reader.lost == [error] and reader.protocol.transport is None


# -- writing -------------------------------------------------------------------------------


class FakeTransport(asyncio.Transport):
    """Records each writelines call."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[list[bytes | memoryview]] = []
        self.closing = False

    def writelines(self, list_of_data: Iterable[Any]) -> None:
        self.writes.append(list(list_of_data))

    def is_closing(self) -> bool:
        return self.closing


def _connected() -> tuple[FrameProtocol, FakeTransport]:
    protocol = FrameProtocol(lambda message: None, lambda exc: None)
    transport = FakeTransport()
    protocol.connection_made(transport)
    return protocol, transport


async def test_sends_of_one_turn_leave_in_one_writelines() -> None:
    protocol, transport = _connected()
    large = np.arange(1 << 14, dtype=np.float64)
    messages = [(3, 1, True), (3, 2, large), (4, 3, "error"), (7, "log_settings", {"a": 1})]
    for message in messages:
        protocol.send(message)
    assert transport.writes == []  # nothing leaves before the loop turns
    await asyncio.sleep(0)
    assert len(transport.writes) == 1
    [parts] = transport.writes
    # One frame: its header counts every byte of the write.
    assert int.from_bytes(bytes(parts[0])[:HEADER], "little") == sum(len(part) for part in parts) - HEADER
    assert any(isinstance(part, memoryview) and _address(part) == _address(large) for part in parts)
    reader = Reader()
    reader.feed(b"".join(bytes(part) for part in parts), CHUNK)
    _assert_same(reader.messages, messages)
    # A later turn's sends are a write of their own.
    protocol.send((3, 5, "later"))
    protocol.send((3, 6, "later too"))
    await asyncio.sleep(0)
    assert len(transport.writes) == 2
    reader = Reader()
    reader.feed(b"".join(bytes(part) for part in transport.writes[1]), CHUNK)
    assert reader.messages == [(3, 5, "later"), (3, 6, "later too")]


async def test_riders_join_the_next_frame_that_leaves_and_send_none_of_their_own() -> None:
    waiting: list[Any] = []

    def riders() -> list[Any]:
        taken = list(waiting)
        waiting.clear()
        return taken

    protocol = FrameProtocol(lambda message: None, lambda exc: None, riders=riders)
    transport = FakeTransport()
    protocol.connection_made(transport)
    waiting.append((8, (1, 2)))
    await asyncio.sleep(0)
    assert transport.writes == []  # riders alone make no frame
    protocol.send((3, 1, "submission"))
    await asyncio.sleep(0)
    [parts] = transport.writes
    reader = Reader()
    reader.feed(b"".join(bytes(part) for part in parts), CHUNK)
    assert reader.messages == [(3, 1, "submission"), (8, (1, 2))]  # one frame, one write
    protocol.send((3, 2, "next"))
    await asyncio.sleep(0)
    reader = Reader()
    reader.feed(b"".join(bytes(part) for part in transport.writes[1]), CHUNK)
    assert reader.messages == [(3, 2, "next")]  # taken once


async def test_nothing_is_written_to_a_closing_transport() -> None:
    protocol, transport = _connected()
    protocol.send((3, 1, "queued"))
    transport.closing = True
    protocol.send((3, 2, "dropped"))
    await asyncio.sleep(0)
    assert transport.writes == []
    unconnected = FrameProtocol(lambda message: None, lambda exc: None)
    unconnected.send((3, 3, "no transport"))  # dropped, not an error


async def test_an_unpicklable_message_fails_its_send_and_spoils_nothing_queued() -> None:
    unsendable: list[tuple[Any, Exception]] = []
    protocol = FrameProtocol(lambda message: None, lambda exc: None, on_unsendable=lambda *bad: unsendable.append(bad))
    transport = FakeTransport()
    protocol.connection_made(transport)
    bad = (3, 2, lambda: None)
    protocol.send((3, 1, "good"))
    protocol.send(bad)
    protocol.send((3, 3, "good too"))
    await asyncio.sleep(0)
    # The bad one is reported as unsendable, with why; it is not written.
    assert [message for message, _ in unsendable] == [bad]
    assert isinstance(unsendable[0][1], (pickle.PicklingError, TypeError, AttributeError))
    # The others of its turn still leave, in order, and in the same write.
    assert len(transport.writes) == 1
    reader = Reader()
    reader.feed(b"".join(bytes(part) for part in transport.writes[0]), CHUNK)
    assert reader.messages == [(3, 1, "good"), (3, 3, "good too")]
    # Nothing of it lingers into the next turn.
    protocol.send((3, 4, "later"))
    await asyncio.sleep(0)
    reader = Reader()
    reader.feed(b"".join(bytes(part) for part in transport.writes[1]), CHUNK)
    assert reader.messages == [(3, 4, "later")] and len(unsendable) == 1


async def test_drained_waits_while_writing_is_paused() -> None:
    protocol, _ = _connected()
    await asyncio.wait_for(protocol.drained(), 1)  # not paused: at once
    protocol.pause_writing()
    waiting = asyncio.ensure_future(protocol.drained())
    await asyncio.sleep(0)
    assert not waiting.done()
    protocol.resume_writing()
    await asyncio.wait_for(waiting, 1)
    protocol.pause_writing()
    waiting = asyncio.ensure_future(protocol.drained())
    await asyncio.sleep(0)
    protocol.connection_lost(None)  # a peer that went away releases a waiting writer too
    await asyncio.wait_for(waiting, 1)
