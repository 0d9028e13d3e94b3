"""RemoteEngineLink: a protocol process's engine, reached over its channel; requests cross as submissions."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import Any

from geserve._generated import model_config_pb2 as mc
from geserve.core.shared_memory import RegionMirror
from geserve.errors import InternalError, UnavailableError
from geserve.lingering import LingeringIds
from geserve.multiprocess.calls import (
    MODELS_EVENT,
    REGIONS_EVENT,
    SNAPSHOTS_METHOD,
    Kind,
)
from geserve.multiprocess.framing import FrameProtocol
from geserve.residency import Lease
from geserve.snapshots import ModelView
from geserve.submissions import Answer, Submission

logger = logging.getLogger(__name__)

ENGINE_GONE = "the inference engine is not running"
EventHandler = Callable[[str, Any], None]


class RemoteEngineLink:
    """The engine over one unix-socket connection. Calls and submissions are answered by id, so any number are in
    flight at once; one whose caller is cancelled (a client that went away) is cancelled in the engine too, and its
    inputs are kept until the engine has answered it (a worker may be reading them). An answer's outputs lie where the
    worker left them: they are held until every array made of them here is gone, then released in the engine. The
    served models and the client regions are the engine's latest snapshots."""

    def __init__(self, on_event: EventHandler | None = None) -> None:
        self._ids = itertools.count(1)
        self._calls: dict[int, asyncio.Future[Any]] = {}
        # A submission's inputs, kept until the engine answers it, even once its caller gave up.
        self._kept: dict[int, Submission] = {}
        self._streams: dict[int, asyncio.Queue[tuple[int, Any]]] = {}
        self._on_event = on_event
        self._channel = FrameProtocol(
            self._received, self._lost, on_unsendable=self._unsendable, riders=self._riding_releases
        )
        self._models: dict[str, ModelView] = {}
        self._regions = RegionMirror()
        # Answers whose outputs are no longer read here: released with the next frame to the engine, or together in
        # a frame of their own when none leaves soon.
        self._releases = LingeringIds(self._send_releases)
        self.lost = asyncio.Event()  # set when the engine's end closes
        self._told = asyncio.Event()  # the engine's first snapshots are in

    async def connect(self, path: str) -> None:
        """Connect, and wait for the engine's first snapshots: no request is checked before they are in."""
        self._releases.start()
        await asyncio.get_running_loop().create_unix_connection(lambda: self._channel, path)
        told = asyncio.ensure_future(self._told.wait())
        lost = asyncio.ensure_future(self.lost.wait())
        await asyncio.wait([told, lost], return_when=asyncio.FIRST_COMPLETED)
        told.cancel()
        lost.cancel()

    def close(self) -> None:
        if self._channel.transport is not None:
            self._channel.transport.close()
        self._regions.close()

    @property
    def models(self) -> Mapping[str, ModelView]:
        return self._models

    @property
    def regions(self) -> RegionMirror:
        return self._regions

    # -- the channel -----------------------------------------------------------------------

    def _received(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == Kind.EVENT:
            self._event(message[1], message[2])
            return
        call_id = message[1]
        if kind in (Kind.RESULT, Kind.ERROR, Kind.END):
            self._kept.pop(call_id, None)
        if kind in (Kind.RESULT, Kind.ITEM) and len(message) > 3:
            self._hold(message[2], message[3])
        if kind in (Kind.RESULT, Kind.ERROR):
            future = self._calls.pop(call_id, None)
            if future is not None and not future.done():
                if kind == Kind.RESULT:
                    future.set_result(message[2])
                else:
                    future.set_exception(message[2])
                return
        queue = self._streams.get(call_id)
        if queue is not None:
            queue.put_nowait((kind, message[2] if len(message) > 2 else None))

    def _event(self, name: str, value: Any) -> None:
        if name == MODELS_EVENT:
            self._models = value
            self._told.set()
        elif name == REGIONS_EVENT:
            self._regions.apply(value)
        elif self._on_event is not None:
            self._on_event(name, value)

    def _hold(self, answer: Answer, lease_id: int) -> None:
        """An answer's outputs are held in the engine until released from here, once nothing here reads them."""
        if answer.outputs:
            lease = Lease(lease_id, self._release)
            for tensor in answer.outputs.values():
                tensor.lease = lease
        else:
            self._release(lease_id)

    def _release(self, lease_id: object) -> None:
        """Called wherever the last array of an answer died (any thread): released with the next frame."""
        assert isinstance(lease_id, int)
        self._releases.add(lease_id)

    def _send_releases(self, released: tuple[int, ...]) -> None:
        if not self.lost.is_set():
            self._channel.send((Kind.RELEASE, released))

    def _riding_releases(self) -> list[tuple[Any, ...]]:
        released = self._releases.take()
        return [(Kind.RELEASE, released)] if released else []

    def _unsendable(self, message: tuple[Any, ...], error: Exception) -> None:
        """A call whose arguments cannot be pickled fails with why; nothing of it reached the engine."""
        future = self._calls.pop(message[1], None) if message[0] in (Kind.CALL, Kind.STREAM) else None
        if future is not None and not future.done():
            future.set_exception(InternalError(f"the call cannot be sent to the engine: {error}"))
        queue = self._streams.get(message[1]) if message[0] == Kind.STREAM else None
        if queue is not None:
            queue.put_nowait((Kind.ERROR, InternalError(f"the call cannot be sent to the engine: {error}")))

    def _lost(self, exc: Exception | None) -> None:
        self.lost.set()
        error = UnavailableError(ENGINE_GONE)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        self._calls.clear()
        self._kept.clear()
        for queue in self._streams.values():
            queue.put_nowait((Kind.ERROR, error))

    async def _call(self, method: str, *args: Any, keep: Submission | None = None) -> Any:
        if self.lost.is_set():
            raise UnavailableError(ENGINE_GONE)
        call_id = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        if keep is not None:
            self._kept[call_id] = keep
        self._channel.send((Kind.CALL, call_id, method, args))
        try:
            return await future
        except asyncio.CancelledError:
            if self._calls.pop(call_id, None) is not None:
                self._channel.send((Kind.CANCEL, call_id))
            raise

    # -- what the front door asks ------------------------------------------------------------

    async def infer(self, submission: Submission) -> Answer:
        answer: Answer = await self._call("infer_submission", submission, keep=submission)
        return answer

    async def stream(self, submission: Submission) -> AsyncGenerator[Answer]:
        if self.lost.is_set():
            raise UnavailableError(ENGINE_GONE)
        call_id = next(self._ids)
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._streams[call_id] = queue
        self._kept[call_id] = submission
        self._channel.send((Kind.STREAM, call_id, "stream_submission", (submission,)))
        finished = False
        try:
            while True:
                kind, value = await queue.get()
                if kind == Kind.ITEM:
                    yield value
                    continue
                finished = True
                if kind == Kind.ERROR:
                    raise value
                return
        finally:
            self._streams.pop(call_id, None)
            if not finished and not self.lost.is_set():
                self._channel.send((Kind.CANCEL, call_id))

    async def refresh(self) -> bool:
        models, regions = await self._call(SNAPSHOTS_METHOD)
        self._models = models
        self._regions.apply(regions)
        return True

    def refused(self, model_name: str, version: int) -> None:
        # Sent without waiting for the answer (dropped when it comes): only the engine's statistics change.
        if not self.lost.is_set():
            self._channel.send((Kind.CALL, next(self._ids), "refused", (model_name, version)))

    async def call(self, method: str, *args: Any) -> Any:
        if method == "record_trace":
            # The front-end has answered its client already, and the engine writes the trace: not waited for.
            if not self.lost.is_set():
                self._channel.send((Kind.CALL, next(self._ids), method, args))
            return None
        value = await self._call(method, *args)
        if method == "model_config":
            config = mc.ModelConfig()
            config.ParseFromString(value)  # generated protobuf classes do not pickle by reference
            return config
        return value
