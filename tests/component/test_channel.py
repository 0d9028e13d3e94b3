"""WorkerChannel on its own: a pipe whose worker end the test drives, answering, streaming, dying."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from geserve.errors import InternalError, InvalidArgumentError, UnavailableError
from geserve.lingering import LINGER_S
from geserve.types import InstanceStatus
from geserve.workers import messages, pipe
from geserve.workers.channel import Lifecycle, WorkerChannel
from geserve.workers.runs import RunId
from geserve.workers.shm import SHM_DIRECTORY, write_tensors
from geserve.workers.streams import ResponseStream, StreamState

RUN = RunId.current()

Call = messages.BlsCall | messages.ControlCall  # what a worker asks of the server
Reply = messages.BlsReply | messages.ControlReply


class Ends:
    """A channel over a pipe, the worker's end of that pipe, and what the channel handed on."""

    def __init__(self) -> None:
        front, self.worker = multiprocessing.Pipe(duplex=True)
        self.lifecycle: list[Lifecycle] = []
        self.bls_calls: list[tuple[Call, Callable[[Reply], None]]] = []
        self.lost = asyncio.Event()
        self.channel = WorkerChannel(
            front, "echo_0", self._serve_bls, on_lifecycle=self.lifecycle.append, on_lost=self.lost.set
        )

    def _serve_bls(self, call: Call, reply: Callable[[Reply], None]) -> None:
        self.bls_calls.append((call, reply))

    def received(self) -> object:
        """The next message the channel sent to the worker."""
        assert self.worker.poll(5), "the channel sent nothing"
        return self.worker.recv()


@pytest.fixture
async def ends() -> AsyncIterator[Ends]:
    ends = Ends()
    yield ends
    ends.channel.close()
    ends.worker.close()


def batch(ends: Ends) -> messages.RunBatch:
    return messages.RunBatch(ends.channel.new_id(), (), ("OUT",), ())


def placed(batch_id: int, start_ns: int = 0) -> messages.BatchPlaced:
    return messages.BatchPlaced(batch_id, (), (), start_ns, start_ns + 1)


def segment_exists(name: str) -> bool:
    return Path(SHM_DIRECTORY / name).exists()


async def test_answers_resolve_their_own_batches_whatever_their_order(ends: Ends) -> None:
    # Two callers at once: each batch has its own id, and the answers come back the other way round.
    first, second = batch(ends), batch(ends)
    running = [asyncio.ensure_future(ends.channel.run(message)) for message in (first, second)]
    await asyncio.sleep(0)
    assert [ends.received(), ends.received()] == [first, second]
    assert ends.channel.in_flight == 2
    ends.worker.send(placed(second.batch_id, 20))
    ends.worker.send(placed(first.batch_id, 10))
    answers = await asyncio.wait_for(asyncio.gather(*running), 5)
    assert [answer.infer_start_ns for answer in answers] == [10, 20]
    assert ends.channel.in_flight == 0


async def test_released_outputs_ride_on_the_next_batch_or_leave_together_after_the_linger(ends: Ends) -> None:
    # Readers let go of a batch's outputs on the loop or on another thread.
    reader = threading.Thread(target=ends.channel.release, args=(4,))
    reader.start()
    reader.join()
    ends.channel.release(5)
    await asyncio.sleep(0)
    assert not ends.worker.poll(0)  # waiting for a batch to ride on
    next_batch = batch(ends)
    running = asyncio.ensure_future(ends.channel.run(next_batch))
    await asyncio.sleep(0)
    assert ends.received() == replace(next_batch, released=(4, 5))  # one message for all three
    ends.worker.send(placed(next_batch.batch_id))
    await asyncio.wait_for(running, 5)
    await asyncio.sleep(LINGER_S * 4)
    assert not ends.worker.poll(0)  # nothing else was sent for them
    # No batch follows: they leave together in a Release of their own, after the linger.
    ends.channel.release(6)
    ends.channel.release(7)
    await asyncio.sleep(0)
    assert not ends.worker.poll(0)
    await asyncio.sleep(LINGER_S * 4)
    assert ends.received() == messages.Release((6, 7))


async def test_releases_riding_on_a_batch_over_the_limit_still_leave(
    ends: Ends, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pipe, "MAX_MESSAGE_BYTES", 1 << 16)
    ends.channel.release(8)
    oversized = messages.RunBatch(ends.channel.new_id(), (), ("X" * (1 << 17),), ())
    with pytest.raises(InvalidArgumentError):
        await ends.channel.run(oversized)
    assert ends.received() == messages.Release((8,))


async def test_a_lost_connection_closes_the_channel_and_fail_ends_everything_in_flight(ends: Ends) -> None:
    running = asyncio.ensure_future(ends.channel.run(batch(ends)))
    stream = ResponseStream()
    ends.channel.open_streams({0: stream})
    status = asyncio.ensure_future(ends.channel.read_status())
    await asyncio.sleep(0)
    ends.worker.close()
    await asyncio.wait_for(ends.lost.wait(), 5)
    assert not ends.channel.open
    assert not running.done()  # the reason is the supervisor's to give, once it has reaped the exit
    ends.channel.fail(UnavailableError("instance 'echo_0' exited unexpectedly (exit code -9)"))
    with pytest.raises(UnavailableError, match=r"exited unexpectedly \(exit code -9\)"):
        await asyncio.wait_for(running, 1)
    assert await asyncio.wait_for(status, 1) is None
    [(outputs, error, final)] = [item async for item in stream.responses()]
    assert outputs is None and final and isinstance(error, UnavailableError)
    assert await ends.channel.read_status() is None  # nothing is sent on a closed channel


async def test_a_batch_on_a_closed_channel_raises_at_once(ends: Ends) -> None:
    ends.channel.close()
    with pytest.raises(OSError):
        await ends.channel.run(batch(ends))
    assert ends.channel.in_flight == 0


async def test_partials_feed_their_stream_until_the_final_one(ends: Ends) -> None:
    stream = ResponseStream()
    [stream_id] = ends.channel.open_streams({3: stream}).values()
    large = np.arange(1000, dtype=np.float32)
    refs = write_tensors({"OUT": large}, RUN.segment_name("stream"))
    ends.worker.send(messages.Partial(stream_id, {"OUT": np.ones(2, np.float32)}, (), None, False))
    ends.worker.send(messages.Partial(stream_id, None, refs, None, True))
    items = [item async for item in stream.responses()]
    assert [final for _, _, final in items] == [False, True]
    first, last = items[0][0], items[1][0]
    assert first is not None and last is not None
    np.testing.assert_array_equal(first["OUT"].array, np.ones(2, np.float32))
    np.testing.assert_array_equal(last["OUT"].array, large)
    assert not segment_exists(refs[0].segment)  # read once, then unlinked
    assert stream.state is StreamState.ENDED


async def test_a_partial_of_a_forgotten_stream_is_dropped_and_its_segment_unlinked(ends: Ends) -> None:
    stream = ResponseStream()
    [stream_id] = ends.channel.open_streams({0: stream}).values()
    ends.channel.forget_streams([stream_id])
    refs = write_tensors({"OUT": np.arange(1000, dtype=np.float32)}, RUN.segment_name("stream"))
    ends.worker.send(messages.Partial(stream_id, None, refs, None, False))
    for _ in range(500):
        if not segment_exists(refs[0].segment):
            break
        await asyncio.sleep(0.01)
    assert not segment_exists(refs[0].segment)
    assert stream.state is StreamState.OPEN and stream._items.empty()


async def test_a_cancelled_stream_tells_the_worker_and_drops_what_follows(ends: Ends) -> None:
    stream = ResponseStream()
    [stream_id] = ends.channel.open_streams({0: stream}).values()
    stream.cancel()
    assert ends.received() == messages.Cancel(stream_id)
    assert stream_id not in ends.channel._streams  # forgotten at once, not when the worker ends it
    # What the worker still sends is dropped by the channel itself, its segment released unread.
    refs = write_tensors({"OUT": np.arange(1000, dtype=np.float32)}, RUN.segment_name("stream"))
    ends.worker.send(messages.Partial(stream_id, None, refs, None, True))
    ends.worker.send(messages.Loaded(b""))  # a marker: once it is seen, the partial before it was handled
    while not ends.lifecycle:  # noqa: ASYNC110
        await asyncio.sleep(0.01)
    assert not segment_exists(refs[0].segment)
    assert stream._items.empty()


async def test_status_readers_get_a_read_sent_after_they_asked_and_share_it(ends: Ends) -> None:
    """A read already on its way when a caller asks may predate what the caller wants to see (a scrape after the
    execute that set a metric): those callers wait it out and share one read sent after it."""
    reads = [asyncio.ensure_future(ends.channel.read_status()) for _ in range(3)]
    await asyncio.sleep(0)
    assert ends.received() == messages.ReadStatus()
    assert not ends.worker.poll(0.05)  # nothing more while the first read is on its way
    ends.worker.send(messages.StatusReport(InstanceStatus(ready=False)))
    assert await asyncio.wait_for(reads[0], 5) == InstanceStatus(ready=False)
    await asyncio.sleep(0.05)  # the other two wake and send theirs
    assert ends.received() == messages.ReadStatus()  # one more, for the two that asked after it was sent
    assert not ends.worker.poll(0.05)
    ends.worker.send(messages.StatusReport(InstanceStatus(ready=True)))
    statuses = await asyncio.wait_for(asyncio.gather(*reads), 5)
    assert statuses == [InstanceStatus(ready=False), InstanceStatus(ready=True), InstanceStatus(ready=True)]


async def test_lifecycle_messages_go_to_the_supervisor_and_bls_calls_to_their_handler(ends: Ends) -> None:
    call = messages.BlsCall(7, "double", "", (), (), "r1", {}, 0, False)
    for message in (messages.Loaded(b"config"), call, messages.Retiring("device lost")):
        ends.worker.send(message)
    while len(ends.lifecycle) < 2:  # noqa: ASYNC110
        await asyncio.sleep(0.01)
    assert ends.lifecycle == [messages.Loaded(b"config"), messages.Retiring("device lost")]
    [(served, reply)] = ends.bls_calls
    assert served == call
    answer = messages.BlsReply(7, write_tensors({"OUT": np.ones(3, np.int32)}, RUN.segment_name("blsout")), None, True)
    reply(answer)
    assert ends.received() == answer
    ends.channel.shutdown()
    assert ends.received() == messages.Shutdown()
    # The worker never read the reply's segment: closing the channel unlinks it.
    ends.channel.close()
    assert not segment_exists(answer.outputs[0].segment)


async def test_a_reply_after_the_connection_ended_is_unlinked_not_sent(ends: Ends) -> None:
    ends.channel.close()
    answer = messages.BlsReply(
        1, write_tensors({"OUT": np.ones(3, np.int32)}, RUN.segment_name("blsout")), InternalError("x"), True
    )
    ends.channel.reply(answer)
    assert not segment_exists(answer.outputs[0].segment)
    with pytest.raises(EOFError):  # nothing came before the end of the pipe
        ends.worker.recv()


# -- messages of any size (issue 34: a half-written message wedged the model for good) ----------------------


async def test_a_batch_larger_than_the_pipe_buffer_reaches_the_worker_whole(ends: Ends) -> None:
    # Several MiB of request ids: far more than a socket pair holds, so the channel must finish it later.
    info = messages.RequestInfo(1, ("OUT",), "r" * (4 << 20), {"key": "v" * (1 << 20)})
    message = messages.RunBatch(ends.channel.new_id(), (), ("OUT",), (info,))
    running = asyncio.ensure_future(ends.channel.run(message))
    following = batch(ends)
    second = asyncio.ensure_future(ends.channel.run(following))
    received = await asyncio.wait_for(asyncio.to_thread(ends.worker.recv), 30)
    assert received.batch_id == message.batch_id and received.requests == (info,)
    assert (await asyncio.wait_for(asyncio.to_thread(ends.worker.recv), 30)).batch_id == following.batch_id
    ends.worker.send(placed(message.batch_id))
    ends.worker.send(placed(following.batch_id))
    assert (await asyncio.wait_for(running, 5)).batch_id == message.batch_id
    assert (await asyncio.wait_for(second, 5)).batch_id == following.batch_id


async def test_a_response_larger_than_the_pipe_buffer_reaches_its_stream_whole() -> None:
    front, worker = multiprocessing.Pipe(duplex=True)
    os.set_blocking(front.fileno(), False)  # as uvloop's readers leave it: a read may stop mid-message
    lost = asyncio.Event()
    channel = WorkerChannel(front, "echo_0", lambda call, reply: None, on_lost=lost.set)
    try:
        stream = ResponseStream()
        [stream_id] = channel.open_streams({0: stream}).values()
        text = np.array([b"s" * (1 << 20)], dtype=np.object_)
        sending = asyncio.to_thread(worker.send, messages.Partial(stream_id, {"OUT": text}, (), None, True))
        await asyncio.wait_for(sending, 30)
        [(outputs, error, final)] = [item async for item in stream.responses()]
        assert error is None and final and outputs is not None
        assert outputs["OUT"].array.tolist() == text.tolist()
        assert channel.open and not lost.is_set()
    finally:
        channel.close()
        worker.close()


async def test_a_message_over_the_channel_limit_is_refused_before_a_byte_is_sent(
    ends: Ends, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pipe, "MAX_MESSAGE_BYTES", 1 << 16)
    info = messages.RequestInfo(1, ("OUT",), "r" * (1 << 17))
    refused = messages.RunBatch(ends.channel.new_id(), (), ("OUT",), (info,))
    with pytest.raises(InvalidArgumentError, match=r"exceeds the worker channel's limit of 65536 bytes"):
        await ends.channel.run(refused)
    following = batch(ends)
    running = asyncio.ensure_future(ends.channel.run(following))
    await asyncio.sleep(0)  # the task sends it
    sent = ends.received()
    assert isinstance(sent, messages.RunBatch) and sent.batch_id == following.batch_id  # nothing of the refused one
    ends.worker.send(placed(following.batch_id))
    assert (await asyncio.wait_for(running, 5)).batch_id == following.batch_id
