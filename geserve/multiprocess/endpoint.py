"""EngineEndpoint: the engine's end of the channel; runs each call a protocol process sends on the InferenceService."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from geserve.core.api import InferenceAPI
from geserve.errors import CancelledError, GeserveError, InternalError
from geserve.multiprocess.arena import ArenaViews
from geserve.multiprocess.calls import CALL_METHODS, LOG_SETTINGS_EVENT, STREAM_METHODS, Kind
from geserve.multiprocess.framing import FrameProtocol
from geserve.types import StreamedResponse

logger = logging.getLogger(__name__)


class EngineEndpoint:
    """Serves `api` on a unix socket to every protocol process; one connection per process."""

    def __init__(self, api: InferenceAPI) -> None:
        self._api = api
        self._connections: set[_Connection] = set()
        self._server: asyncio.AbstractServer | None = None

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

    def _accept(self) -> FrameProtocol:
        connection = _Connection(self, ArenaViews())
        self._connections.add(connection)
        return connection.channel

    # -- what connections call -------------------------------------------------------------

    def closed(self, connection: _Connection) -> None:
        self._connections.discard(connection)

    async def call(self, method: str, args: tuple[Any, ...], arenas: ArenaViews) -> Any:
        if method == "infer":
            request, refs = args
            return await self._api.infer(arenas.restore(request, refs))
        value = await getattr(self._api, method)(*args)
        if method == "update_log_settings":
            self.broadcast(LOG_SETTINGS_EVENT, value)
        elif method == "model_config":
            return value.SerializeToString()  # generated protobuf classes do not pickle by reference
        return value

    def stream(self, args: tuple[Any, ...], arenas: ArenaViews) -> AsyncIterator[StreamedResponse]:
        request, refs = args
        return self._api.infer_stream(arenas.restore(request, refs))


class _Connection:
    """One protocol process: its calls in flight, each a task answered by id, and the mapping of its arena."""

    def __init__(self, endpoint: EngineEndpoint, arenas: ArenaViews) -> None:
        self._endpoint = endpoint
        self._arenas = arenas
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self.channel = FrameProtocol(self._received, self._lost)

    def close(self) -> None:
        if self.channel.transport is not None:
            self.channel.transport.close()

    def _received(self, message: tuple[Any, ...]) -> None:
        kind, call_id = message[0], message[1]
        if kind == Kind.CANCEL:
            task = self._tasks.get(call_id)
            if task is not None:
                task.cancel()
            return
        method, args = message[2], message[3]
        if kind == Kind.CALL and method in CALL_METHODS:
            work = self._answer(call_id, method, args)
        elif kind == Kind.STREAM and method in STREAM_METHODS:
            work = self._stream(call_id, args)
        else:
            self.channel.send((Kind.ERROR, call_id, InternalError(f"the engine has no call '{method}'")))
            return
        task = asyncio.create_task(work)
        self._tasks[call_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(call_id, None))

    async def _answer(self, call_id: int, method: str, args: tuple[Any, ...]) -> None:
        try:
            value = await self._endpoint.call(method, args, self._arenas)
        except BaseException as error:  # every failure is the caller's answer
            self._fail(call_id, method, error)
            return
        self._send(Kind.RESULT, call_id, value)

    async def _stream(self, call_id: int, args: tuple[Any, ...]) -> None:
        try:
            async for item in self._endpoint.stream(args, self._arenas):
                self._send(Kind.ITEM, call_id, item)
                await self.channel.drained()
        except BaseException as error:  # every failure is the caller's answer
            self._fail(call_id, "infer_stream", error)
            return
        self.channel.send((Kind.END, call_id))

    def _fail(self, call_id: int, method: str, error: BaseException) -> None:
        if isinstance(error, GeserveError):
            answer: GeserveError = error
        elif isinstance(error, asyncio.CancelledError):
            answer = CancelledError("the request was cancelled")
        else:
            logger.error("a call of '%s' failed in the engine", method, exc_info=error)
            answer = InternalError(f"{type(error).__name__}: {error}")
        self.channel.send((Kind.ERROR, call_id, answer))

    def _send(self, kind: Kind, call_id: int, value: Any) -> None:
        try:
            self.channel.send((kind, call_id, value))
        except Exception as error:  # an answer that cannot be pickled is a bug; the caller still hears of it
            logger.exception("the answer to call %d cannot be sent", call_id)
            self.channel.send((Kind.ERROR, call_id, InternalError(f"the answer cannot be sent: {error}")))

    def _lost(self, exc: Exception | None) -> None:
        # The protocol process is gone: what it asked for has no one to answer.
        self._endpoint.closed(self)
        for task in list(self._tasks.values()):
            task.cancel()
        self._arenas.close()  # the mapping goes with the last view of it
