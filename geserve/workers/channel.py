"""WorkerChannel: the front-end's end of one worker's pipe: batches in flight, response streams, status, BLS."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from multiprocessing.connection import Connection

from geserve.errors import GeserveError
from geserve.lingering import LingeringIds
from geserve.types import InstanceStatus, with_parameters
from geserve.workers.batch import Cancellable
from geserve.workers.client import local_tensors
from geserve.workers.messages import (
    BatchPlaced,
    BlsCall,
    BlsCancel,
    BlsReply,
    Cancel,
    ControlCall,
    ControlReply,
    Loaded,
    LoadFailed,
    Partial,
    ReadStatus,
    Release,
    Retiring,
    RunBatch,
    Shutdown,
    StatusReport,
)
from geserve.workers.pipe import PipeEnd
from geserve.workers.shm import take_tensors, unlink_quietly
from geserve.workers.streams import ResponseStream

logger = logging.getLogger(__name__)

# What the worker says about its own life (loaded, could not load, exiting on purpose): its supervisor's business.
Lifecycle = Loaded | LoadFailed | Retiring
# Serves one BLS or model control call of the model, answering through the callback (as often as the call is answered).
BlsHandler = Callable[[BlsCall | BlsCancel | ControlCall, Callable[[BlsReply | ControlReply], None]], None]

# How long a status read waits for the worker, which answers between batches.
STATUS_TIMEOUT_S = 10.0
# Recent BLS reply segments remembered for unlinking, should the worker die before reading them.
_KEPT_REPLY_SEGMENTS = 256


class WorkerChannel:
    """One live connection to a worker process, read on the event loop. Batches and streams are matched to
    the worker's answers by ids of this channel, so any number of callers may use it at once. When the
    connection ends the channel closes itself and calls `on_lost`; whoever watches the process then calls
    `fail` with the reason, which ends everything still waiting on it. It knows nothing of how the process
    was started or whether another one follows."""

    def __init__(
        self,
        connection: Connection,
        name: str,
        serve_bls: BlsHandler,
        on_lifecycle: Callable[[Lifecycle], None] | None = None,
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        self._name = name
        self._serve_bls = serve_bls
        self._on_lifecycle = on_lifecycle
        self._on_lost = on_lost
        self._ids = itertools.count()
        self._in_flight: dict[int, asyncio.Future[BatchPlaced]] = {}
        self._streams: dict[int, ResponseStream] = {}  # open streamed requests, by stream id
        self._status: asyncio.Future[InstanceStatus | None] | None = None
        # BLS replies the worker may not have read yet: a worker that dies cannot unlink them, so we do.
        self._reply_segments: deque[str] = deque(maxlen=_KEPT_REPLY_SEGMENTS)
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        # Batches whose outputs their readers are done with: they ride on the next batch, or leave together in a
        # Release of their own when none follows soon.
        self._releases = LingeringIds(self._send_releases)
        self._releases.start()
        # Read on the loop as the worker writes; messages of any size arrive and leave whole.
        self._pipe = PipeEnd(connection, self._on_message, self._on_pipe_lost)

    @property
    def open(self) -> bool:
        """The connection has neither ended nor been closed."""
        return self._pipe.open

    @property
    def in_flight(self) -> int:
        """Batches sent and not answered yet."""
        return len(self._in_flight)

    # -- batches and streams -----------------------------------------------------------------------

    def new_id(self) -> int:
        """A batch id no other batch of this channel has."""
        return next(self._ids)

    def open_streams(self, streams: Mapping[int, ResponseStream]) -> dict[int, int]:
        """Give each stream (by its request's index in the batch) an id its responses come back under; a
        stream the client cancels tells the worker. Returns index -> stream id."""
        stream_ids: dict[int, int] = {}
        for index, stream in streams.items():
            stream_id = next(self._ids)
            self._streams[stream_id] = stream
            stream.on_cancel(functools.partial(self.cancel, stream_id))
            stream_ids[index] = stream_id
        return stream_ids

    def watch_cancels(self, requests: Mapping[int, Cancellable]) -> dict[int, int]:
        """Give each unary request (by its index in the batch) an id a Cancel names it by, sent should its client
        go away while the batch runs; the caller unregisters them when the batch is back. Returns index -> id."""
        cancel_ids: dict[int, int] = {}
        for index, request in requests.items():
            cancel_id = next(self._ids)
            request.on_cancel(functools.partial(self.cancel, cancel_id))
            cancel_ids[index] = cancel_id
        return cancel_ids

    def forget_streams(self, stream_ids: Iterable[int]) -> None:
        """Drop streams someone else ends (their batch failed): whatever the worker still sends for them is dropped."""
        for stream_id in stream_ids:
            self._streams.pop(stream_id, None)

    async def run(self, message: RunBatch) -> BatchPlaced:
        """Send a batch (its id from `new_id`) and wait for its answer. Raises what `fail` is given when the
        worker dies meanwhile, OSError or ValueError when the connection is already broken or closed, and
        InvalidArgumentError (nothing sent) when the message is over the channel's limit."""
        answer: asyncio.Future[BatchPlaced] = self._loop.create_future()
        self._in_flight[message.batch_id] = answer
        released = self._releases.take()
        if released:
            message = replace(message, released=released)
        try:
            try:
                self._pipe.send(message)
            except GeserveError:  # over the channel's limit, so not sent: the releases still go
                if released:
                    self._send_releases(released)
                raise
            return await answer
        finally:
            self._in_flight.pop(message.batch_id, None)

    def release(self, batch_id: object) -> None:
        """The readers of batch `batch_id`'s outputs are done with them: the worker may reuse their place. Called
        wherever the last reader let go (any thread); sent with the next batch, or with the others released within a
        few milliseconds when no batch follows."""
        assert isinstance(batch_id, int)
        self._releases.add(batch_id)

    def _send_releases(self, released: tuple[int, ...]) -> None:
        self._send_quietly(Release(released))

    def cancel(self, stream_id: int) -> None:
        """The client of a streamed request (or of a running unary one, by its cancel id) went away: tell the
        model, drop what it still sends."""
        self._streams.pop(stream_id, None)
        self._send_quietly(Cancel(stream_id))

    async def read_status(self) -> InstanceStatus | None:
        """Device usage, the model's readiness and metrics, read by the worker between batches, after this call
        began (a scrape sees what execute set just before): a read already on its way when it began is waited out,
        then the next one is shared by every caller that waited. None when the worker cannot say."""
        deadline = self._loop.time() + STATUS_TIMEOUT_S
        earlier = self._status
        if earlier is not None and not earlier.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(earlier), timeout=STATUS_TIMEOUT_S)
        if not self._pipe.open:
            return None
        if self._status is None or self._status is earlier:
            self._status = self._loop.create_future()
            if not self._send_quietly(ReadStatus()):
                return None
        try:
            return await asyncio.wait_for(asyncio.shield(self._status), timeout=max(deadline - self._loop.time(), 0.1))
        except TimeoutError:
            return None

    def shutdown(self) -> None:
        """Ask the worker to unload and exit (it may be gone already)."""
        self._send_quietly(Shutdown())

    # -- the end of the connection ------------------------------------------------------------------

    def fail(self, error: GeserveError) -> None:
        """The worker is gone: every batch in flight and every open stream ends with `error` at once, a status
        read in progress with None."""
        if self._status is not None and not self._status.done():
            self._status.set_result(None)
        for answer in self._in_flight.values():
            if not answer.done():
                answer.set_exception(error)
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.fail(error)

    def close(self) -> None:
        """Stop reading and close the connection; BLS replies sent on it and perhaps never read are unlinked."""
        self._pipe.close()
        while self._reply_segments:
            unlink_quietly(self._reply_segments.popleft())

    def reply(self, answer: BlsReply | ControlReply) -> None:
        """Answer a BLS call of the worker; outputs nobody will read (the connection is gone) are unlinked. An
        answer over the channel's limit is replaced by its error, so the model's call still ends."""
        names = {ref.segment for ref in answer.outputs} if isinstance(answer, BlsReply) else set()
        sent = False
        if self._pipe.open:
            try:
                self._pipe.send(answer)
                sent = True
            except (OSError, ValueError):  # the worker is gone; its exit is reported on its own
                pass
            except GeserveError as error:
                refused: BlsReply | ControlReply = (
                    BlsReply(answer.call_id, (), error, True)
                    if isinstance(answer, BlsReply)
                    else ControlReply(answer.call_id, False, error)
                )
                self._send_quietly(refused)
        if sent:
            self._reply_segments.extend(names)
            return
        for name in names:
            unlink_quietly(name)

    def _send_quietly(self, message: object) -> bool:
        if not self._pipe.open:
            return False
        try:
            self._pipe.send(message)
        except (OSError, ValueError):  # the worker is gone; its exit is reported on its own
            return False
        except GeserveError as error:  # over the channel's limit: nothing was sent
            logger.error("instance %s: %s", self._name, error.message)
            return False
        return True

    # -- what the worker sends ----------------------------------------------------------------------

    def _on_pipe_lost(self) -> None:
        self.close()
        if self._on_lost is not None:
            self._on_lost()

    def _on_message(self, message: object) -> None:
        if isinstance(message, BatchPlaced):
            answer = self._in_flight.get(message.batch_id)
            if answer is not None and not answer.done():
                answer.set_result(message)
        elif isinstance(message, Partial):
            self._on_partial(message)
        elif isinstance(message, BlsCall | BlsCancel | ControlCall):
            self._serve_bls(message, self.reply)
        elif isinstance(message, StatusReport):
            if self._status is not None and not self._status.done():
                self._status.set_result(message.status)
        elif isinstance(message, Loaded | LoadFailed | Retiring):
            if self._on_lifecycle is not None:
                self._on_lifecycle(message)
        else:
            logger.error("instance %s sent an unknown message %r", self._name, type(message).__name__)

    def _on_partial(self, message: Partial) -> None:
        arrays = message.outputs
        if message.refs:
            arrays = take_tensors(message.refs)  # also unlinks the response's own segment
        outputs = local_tensors(arrays) if arrays is not None else None
        if message.parameters:
            outputs = with_parameters(dict(outputs or {}), message.parameters)
        stream = self._streams.pop(message.stream_id, None) if message.final else self._streams.get(message.stream_id)
        if stream is not None:
            stream.put(outputs, message.error, message.final)
