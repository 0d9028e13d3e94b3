"""The worker's ends of its pipe to the front-end: Inbox (messages in) and Outbox (serialized sends)."""

from __future__ import annotations

import logging
import queue
import select
import threading
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

import numpy as np

from geserve.backends.base import ResponseEmitter
from geserve.errors import GeserveError
from geserve.types import response_parameters
from geserve.workers import pipe
from geserve.workers.messages import (
    BlsReply,
    Cancel,
    ControlReply,
    Partial,
    Release,
    RequestInfo,
    RunBatch,
    Shutdown,
)
from geserve.workers.runs import RunId
from geserve.workers.shm import write_tensors

if TYPE_CHECKING:
    from geserve.workers.bls import BlsClient

logger = logging.getLogger(__name__)

# Streamed responses up to this size travel in the message itself; larger ones in a segment.
_INLINE_BYTES = 64 << 10


class Outbox:
    """The pipe to the front-end. Streamed responses may come from a model's own threads while the main
    loop answers batches, so sends are serialized. Segments it creates are named for `run`, the server's."""

    def __init__(self, connection: Connection, run: RunId) -> None:
        self._connection = connection
        self.run = run
        self._lock = threading.Lock()

    def send(self, message: object) -> None:
        """Send one message whole; InvalidArgumentError, with nothing sent, when it is over the channel's limit."""
        data = pipe.dumps(message)  # pickled outside the lock: a model's other threads keep sending meanwhile
        with self._lock:
            self._connection.send_bytes(data)

    def emitter(self, requests: tuple[RequestInfo, ...]) -> ResponseEmitter:
        def emit(index: int, outputs: Mapping[str, np.ndarray] | None, error: GeserveError | None, final: bool) -> None:
            stream_id = requests[index].stream_id
            try:
                try:
                    self.send(self._partial(stream_id, outputs, error, final))
                except GeserveError as refused:  # too large to send: the client learns why
                    self.send(Partial(stream_id, None, (), refused, final))
            except (OSError, ValueError):
                logger.warning("dropping a response of stream %d: the front-end is gone", stream_id)

        return emit

    def _partial(
        self, stream_id: int, outputs: Mapping[str, np.ndarray] | None, error: GeserveError | None, final: bool
    ) -> Partial:
        parameters = response_parameters(outputs)
        if outputs is None or not (outputs or parameters):
            return Partial(stream_id, None, (), error, final)
        arrays = {name: np.asarray(array) for name, array in outputs.items()}
        if sum(array.nbytes for array in arrays.values()) <= _INLINE_BYTES:
            return Partial(stream_id, arrays, (), error, final, parameters)
        refs = write_tensors(arrays, self.run.segment_name("stream"))
        return Partial(stream_id, None, refs, error, final, parameters)


class Inbox:
    """What the front-end sends. A model running its own code may wait inside `execute` for a BLS reply, so
    for those a reader thread takes every message: BLS replies and cancellations are handled at once, the rest
    queue for the main loop. Other backends read the pipe directly, one batch after the other."""

    _END = object()

    def __init__(
        self,
        connection: Connection,
        cancelled: set[int],
        outbox: Outbox,
        threaded: bool,
        *,
        release: Callable[[tuple[int, ...]], None],
        loading: str = "",
    ) -> None:
        self._connection = connection
        self._cancelled = cancelled  # the runner's cancelled requests, which its model reads
        self._release = release  # frees released batches' outputs (thread-safe)
        self._bls: BlsClient | None = None
        self._queue: queue.SimpleQueue[object] | None = None
        # One poll object, made once: Connection.poll builds a selector on every call.
        self._readable = select.poll()
        self._readable.register(connection.fileno(), select.POLLIN)
        self._either: select.poll | None = None  # the pipe or a device waiter's signal
        if threaded:
            # Imported only here: it brings the python backend's pb_utils, which other workers never need.
            from geserve.workers import bls

            self._bls = bls.connect(outbox.send, outbox.run)
            self._bls.loading = loading  # the model whose initialize runs next
            self._queue = queue.SimpleQueue()
            threading.Thread(target=self._read, name="geserve-inbox", daemon=True).start()

    def loaded(self) -> None:
        """The model's initialize has returned: it may load and unload any model from now on."""
        if self._bls is not None:
            self._bls.loading = ""

    @property
    def threaded(self) -> bool:
        return self._queue is not None

    def ready(self, device_done: Connection | None = None) -> bool:
        """Whether a message is waiting (`get` would not block). With `device_done` (a device waiter's signal),
        blocks until either a message comes or the device is done with the running batch (then False, unless
        both are ready)."""
        if self._queue is not None:
            return not self._queue.empty()
        try:
            if device_done is None:
                return bool(self._readable.poll(0))
            if self._either is None:
                self._either = select.poll()
                self._either.register(self._connection.fileno(), select.POLLIN)
                self._either.register(device_done.fileno(), select.POLLIN)
            pipe = self._connection.fileno()
            return any(fd == pipe for fd, _ in self._either.poll())
        except (OSError, ValueError):
            return True  # `get` reports the closed pipe

    def get(self) -> object | None:
        """The next message for the main loop; None when only messages handled here came (a cancellation, released
        outputs) and nothing else waits, so that the loop can turn to a batch the device finished; EOFError once
        the front-end is gone."""
        while True:
            message: object
            if self._queue is not None:  # the reader thread handled cancellations and releases already
                message = self._queue.get()
                if message is self._END:
                    raise EOFError
                return message
            message = self._connection.recv()
            if not self._handled_here(message):
                return message
            if not self.ready():
                return None

    def _handled_here(self, message: object) -> bool:
        """Take a cancellation or released outputs (alone, or riding on a batch); True when that was all it was."""
        if isinstance(message, Cancel):
            self._cancelled.add(message.stream_id)
            return True
        if isinstance(message, Release):
            self._release(message.batch_ids)
            return True
        if isinstance(message, RunBatch) and message.released:
            self._release(message.released)
        return False

    def _read(self) -> None:
        assert self._queue is not None and self._bls is not None
        while True:
            try:
                message = self._connection.recv()
            except (EOFError, OSError):
                self._bls.close()
                self._queue.put(self._END)
                return
            if isinstance(message, BlsReply | ControlReply):
                self._bls.deliver(message)
            elif not self._handled_here(message):
                self._queue.put(message)
                if isinstance(message, Shutdown):
                    return

    def close(self) -> None:
        if self._bls is not None:
            self._bls.close()
