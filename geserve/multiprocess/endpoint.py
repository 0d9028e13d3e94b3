"""EngineEndpoint: the engine's end of the channel; runs each call and submission a protocol process sends."""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from geserve.core.service import InferenceService
from geserve.errors import CancelledError, GeserveError, InternalError
from geserve.multiprocess.calls import (
    CALL_METHODS,
    LOG_SETTINGS_EVENT,
    MODELS_EVENT,
    REGIONS_EVENT,
    SNAPSHOTS_METHOD,
    STREAM_METHODS,
    SUBMIT_METHOD,
    Kind,
)
from geserve.multiprocess.framing import FrameProtocol
from geserve.snapshots import snapshot_of
from geserve.submissions import Answer, Submission

logger = logging.getLogger(__name__)


class EngineEndpoint:
    """Serves the engine on a unix socket to every protocol process, one connection per process; each is told the
    served models and the client regions on connecting, and again whenever they change."""

    def __init__(self, service: InferenceService) -> None:
        self._service = service
        self._connections: set[_Connection] = set()
        self._server: asyncio.AbstractServer | None = None
        self._pending_events: dict[str, None] = {}  # snapshots to push at the end of this turn of the loop
        service.watch(lambda: self._push_soon(MODELS_EVENT), lambda: self._push_soon(REGIONS_EVENT))

    async def start(self, path: str) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(self._accept, path)

    async def stop(self) -> None:
        """Stop accepting connections and close those open (their calls are cancelled)."""
        if self._server is not None:
            self._server.close()
        for connection in list(self._connections):
            connection.close()
        if self._server is not None:
            await self._server.wait_closed()

    def broadcast(self, name: str, value: Any) -> None:
        for connection in self._connections:
            connection.channel.send((Kind.EVENT, name, value))

    def _snapshot(self, name: str) -> Any:
        if name == MODELS_EVENT:
            return snapshot_of(self._service.models)
        return self._service.shared_memory.views()

    def _push_soon(self, name: str) -> None:
        """Tell every protocol process once, at the end of this turn of the loop, however many changes it made."""
        if not self._pending_events:
            asyncio.get_running_loop().call_soon(self._push)
        self._pending_events[name] = None

    def _push(self) -> None:
        names, self._pending_events = list(self._pending_events), {}
        for name in names:
            self.broadcast(name, self._snapshot(name))

    def _accept(self) -> FrameProtocol:
        connection = _Connection(self)
        self._connections.add(connection)
        return connection.channel

    def connected(self, connection: _Connection) -> None:
        """A protocol process connected: it learns what is served and registered before its first request."""
        for name in (MODELS_EVENT, REGIONS_EVENT):
            connection.channel.send((Kind.EVENT, name, self._snapshot(name)))

    # -- what connections call -------------------------------------------------------------

    def closed(self, connection: _Connection) -> None:
        self._connections.discard(connection)

    async def call(self, method: str, args: tuple[Any, ...]) -> Any:
        service = self._service
        if method == SUBMIT_METHOD:
            return await service.infer_submission(args[0])
        if method == "refused":
            service.refused(*args)
            return None
        if method == SNAPSHOTS_METHOD:
            return self._snapshot(MODELS_EVENT), self._snapshot(REGIONS_EVENT)
        value = await getattr(service, method)(*args)
        if method == "update_log_settings":
            self.broadcast(LOG_SETTINGS_EVENT, value)
        elif method == "model_config":
            return value.SerializeToString()  # generated protobuf classes do not pickle by reference
        return value

    def submit(self, submission: Submission, done: Callable[[Answer | GeserveError], None]) -> Callable[[], None]:
        return self._service.submit(submission, done)

    def stream(self, submission: Submission) -> AsyncIterator[Answer]:
        return self._service.stream_submission(submission)


class _Connection:
    """One protocol process: its calls in flight, each a task answered by id, and the answers whose outputs it still
    reads (held until it releases them, or until it is gone)."""

    def __init__(self, endpoint: EngineEndpoint) -> None:
        self._endpoint = endpoint
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._submitted: dict[int, Callable[[], None]] = {}  # what cancels each submission still unanswered
        self._held: dict[int, Answer] = {}
        self._leases = itertools.count(1)
        self.channel = FrameProtocol(self._received, self._lost, lambda: endpoint.connected(self), self._unsendable)

    def close(self) -> None:
        if self.channel.transport is not None:
            self.channel.transport.close()

    def _received(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == Kind.RELEASE:
            for lease_id in message[1]:
                self._held.pop(lease_id, None)  # the outputs' place in the worker's arena is free once none hold it
            return
        call_id = message[1]
        if kind == Kind.CANCEL:
            cancel = self._submitted.get(call_id)
            if cancel is not None:
                cancel()  # answered as cancelled, at once or when its batch is back
            task = self._tasks.get(call_id)
            if task is not None:
                task.cancel()
            return
        method, args = message[2], message[3]
        if kind == Kind.CALL and method == SUBMIT_METHOD:
            # Straight into the scheduler's queue: no task, answered from its batch (or at once, refused).
            self._submitted[call_id] = _not_yet
            cancel = self._endpoint.submit(args[0], functools.partial(self._answered, call_id))
            if call_id in self._submitted:
                self._submitted[call_id] = cancel
            return
        if kind == Kind.CALL and method in CALL_METHODS:
            work = self._answer(call_id, method, args)
        elif kind == Kind.STREAM and method in STREAM_METHODS:
            work = self._stream(call_id, args[0])
        else:
            self.channel.send((Kind.ERROR, call_id, InternalError(f"the engine has no call '{method}'")))
            return
        task = asyncio.create_task(work)
        self._tasks[call_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(call_id, None))

    def _answered(self, call_id: int, outcome: Answer | GeserveError) -> None:
        self._submitted.pop(call_id, None)
        if isinstance(outcome, GeserveError):
            self.channel.send((Kind.ERROR, call_id, outcome))
        else:
            self._send(Kind.RESULT, call_id, outcome, self._lease(outcome))

    async def _answer(self, call_id: int, method: str, args: tuple[Any, ...]) -> None:
        try:
            value = await self._endpoint.call(method, args)
        except BaseException as error:  # every failure is the caller's answer
            self._fail(call_id, method, error)
            return
        if isinstance(value, Answer):
            self._send(Kind.RESULT, call_id, value, self._lease(value))
        else:
            self._send(Kind.RESULT, call_id, value)

    async def _stream(self, call_id: int, submission: Submission) -> None:
        try:
            async for answer in self._endpoint.stream(submission):
                self._send(Kind.ITEM, call_id, answer, self._lease(answer))
                await self.channel.drained()
        except BaseException as error:  # every failure is the caller's answer
            self._fail(call_id, "stream_submission", error)
            return
        self.channel.send((Kind.END, call_id))

    def _lease(self, answer: Answer) -> int:
        """Hold the answer (and with it its outputs' place in the worker's arena) until the process releases it."""
        lease_id = next(self._leases)
        if answer.outputs:
            self._held[lease_id] = answer
        return lease_id

    def _fail(self, call_id: int, method: str, error: BaseException) -> None:
        if isinstance(error, GeserveError):
            answer: GeserveError = error
        elif isinstance(error, asyncio.CancelledError):
            answer = CancelledError("the request was cancelled")
        else:
            logger.error("a call of '%s' failed in the engine", method, exc_info=error)
            answer = InternalError(f"{type(error).__name__}: {error}")
        self.channel.send((Kind.ERROR, call_id, answer))

    def _send(self, kind: int, call_id: int, *values: Any) -> None:
        self.channel.send((kind, call_id, *values))

    def _unsendable(self, message: tuple[Any, ...], error: Exception) -> None:
        """An answer that cannot be pickled is a bug; the caller still hears of it."""
        kind, call_id = message[0], message[1]
        logger.error("a message (kind %d) to a protocol process cannot be sent", kind, exc_info=error)
        if kind in (Kind.RESULT, Kind.ITEM):
            self.channel.send((Kind.ERROR, call_id, InternalError(f"the answer cannot be sent: {error}")))

    def _lost(self, exc: Exception | None) -> None:
        # The protocol process is gone: what it asked for has no one to answer, and what it read, no reader.
        self._endpoint.closed(self)
        for task in list(self._tasks.values()):
            task.cancel()
        for cancel in list(self._submitted.values()):
            cancel()
        self._held.clear()


def _not_yet() -> None:
    """A submission's canceller until its scheduler has it."""
