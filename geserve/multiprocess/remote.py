"""RemoteInferenceAPI: the InferenceAPI of a protocol process, each call answered by the engine over its channel."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from geserve._generated import model_config_pb2 as mc
from geserve.core.api import InferenceAPI
from geserve.errors import UnavailableError
from geserve.multiprocess.arena import RequestArena, to_engine
from geserve.multiprocess.calls import Kind
from geserve.multiprocess.framing import FrameProtocol
from geserve.types import (
    CacheSnapshot,
    CustomMetric,
    DeviceUsage,
    InferRequest,
    InferResponse,
    ModelMetadata,
    ServerMetadata,
    StreamedResponse,
    TraceRecord,
    VersionSnapshot,
)

logger = logging.getLogger(__name__)

ENGINE_GONE = "the inference engine is not running"
EventHandler = Callable[[str, Any], None]


class RemoteInferenceAPI:
    """Calls the engine's InferenceService by name over one unix-socket connection; answers are matched to
    calls by id, so any number are in flight at once. A call whose caller is cancelled (a client that went
    away) is cancelled in the engine too."""

    def __init__(self, on_event: EventHandler | None = None, arena: RequestArena | None = None) -> None:
        self._ids = itertools.count(1)
        self._arena = arena
        self._calls: dict[int, asyncio.Future[Any]] = {}
        # What a call's arena blocks need kept alive until the engine answers it, even once its caller gave up.
        self._kept: dict[int, list[Any]] = {}
        self._streams: dict[int, asyncio.Queue[tuple[Kind, Any]]] = {}
        self._on_event = on_event
        self._channel = FrameProtocol(self._received, self._lost)
        self.lost = asyncio.Event()  # set when the engine's end closes

    async def connect(self, path: str) -> None:
        loop = asyncio.get_running_loop()
        await loop.create_unix_connection(lambda: self._channel, path)

    def close(self) -> None:
        if self._channel.transport is not None:
            self._channel.transport.close()

    # -- the channel -----------------------------------------------------------------------

    def _received(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == Kind.EVENT:
            if self._on_event is not None:
                self._on_event(message[1], message[2])
            return
        call_id = message[1]
        if kind in (Kind.RESULT, Kind.ERROR, Kind.END):
            self._kept.pop(call_id, None)
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
            queue.put_nowait((Kind(kind), message[2] if len(message) > 2 else None))

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

    async def _call(self, method: str, *args: Any, keep: list[Any] | None = None) -> Any:
        if self.lost.is_set():
            raise UnavailableError(ENGINE_GONE)
        call_id = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        if keep:
            self._kept[call_id] = keep
        self._channel.send((Kind.CALL, call_id, method, args))
        try:
            return await future
        except asyncio.CancelledError:
            if self._calls.pop(call_id, None) is not None:
                self._channel.send((Kind.CANCEL, call_id))
            raise

    # -- health and metadata ---------------------------------------------------------------

    async def live(self) -> bool:
        return bool(await self._call("live"))

    async def ready(self) -> bool:
        return bool(await self._call("ready"))

    async def server_metadata(self) -> ServerMetadata:
        metadata: ServerMetadata = await self._call("server_metadata")
        return metadata

    async def model_ready(self, name: str, version: str = "") -> bool:
        return bool(await self._call("model_ready", name, version))

    async def model_metadata(self, name: str, version: str = "") -> ModelMetadata:
        metadata: ModelMetadata = await self._call("model_metadata", name, version)
        return metadata

    async def model_config(self, name: str, version: str = "") -> mc.ModelConfig:
        config = mc.ModelConfig()
        config.ParseFromString(await self._call("model_config", name, version))
        return config

    # -- inference -------------------------------------------------------------------------

    async def infer(self, request: InferRequest) -> InferResponse:
        if self._arena is None:
            response: InferResponse = await self._call("infer", request, ())
            return response
        outgoing, refs, keep = to_engine(request, self._arena)
        response = await self._call("infer", outgoing, refs, keep=keep)
        return response

    async def infer_stream(self, request: InferRequest) -> AsyncIterator[StreamedResponse]:
        if self.lost.is_set():
            raise UnavailableError(ENGINE_GONE)
        call_id = next(self._ids)
        queue: asyncio.Queue[tuple[Kind, Any]] = asyncio.Queue()
        self._streams[call_id] = queue
        if self._arena is None:
            self._channel.send((Kind.STREAM, call_id, "infer_stream", (request, ())))
        else:
            outgoing, refs, keep = to_engine(request, self._arena)
            self._kept[call_id] = keep
            self._channel.send((Kind.STREAM, call_id, "infer_stream", (outgoing, refs)))
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

    # -- the model repository extension ----------------------------------------------------

    async def repository_index(self, ready_only: bool = False) -> list[dict[str, str]]:
        index: list[dict[str, str]] = await self._call("repository_index", ready_only)
        return index

    async def load_model(self, name: str, parameters: Mapping[str, Any] | None = None) -> None:
        await self._call("load_model", name, dict(parameters) if parameters is not None else None)

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        await self._call("unload_model", name, unload_dependents)

    # -- the shared-memory extensions ------------------------------------------------------

    async def shared_memory_status(self, name: str = "") -> list[dict[str, Any]]:
        status: list[dict[str, Any]] = await self._call("shared_memory_status", name)
        return status

    async def register_shared_memory(self, name: str, key: Any, offset: Any, byte_size: Any) -> None:
        await self._call("register_shared_memory", name, key, offset, byte_size)

    async def unregister_shared_memory(self, name: str = "") -> None:
        await self._call("unregister_shared_memory", name)

    async def cuda_shared_memory_status(self, name: str = "") -> list[dict[str, Any]]:
        status: list[dict[str, Any]] = await self._call("cuda_shared_memory_status", name)
        return status

    async def register_cuda_shared_memory(self) -> None:
        await self._call("register_cuda_shared_memory")

    async def unregister_cuda_shared_memory(self, name: str = "") -> None:
        await self._call("unregister_cuda_shared_memory", name)

    # -- the trace and logging extensions --------------------------------------------------

    async def trace_settings(self, model: str | None = None) -> dict[str, list[str] | str]:
        settings: dict[str, list[str] | str] = await self._call("trace_settings", model)
        return settings

    async def update_trace_settings(self, model: str | None, changes: Mapping[str, Any]) -> dict[str, Any]:
        settings: dict[str, Any] = await self._call("update_trace_settings", model, dict(changes))
        return settings

    async def record_trace(self, trace: TraceRecord) -> None:
        # Sent without waiting for the answer (which nobody awaits, so it is dropped when it comes): the
        # front-end has answered its client already, and the engine writes the trace.
        if not self.lost.is_set():
            self._channel.send((Kind.CALL, next(self._ids), "record_trace", (trace,)))

    async def log_settings(self) -> dict[str, Any]:
        settings: dict[str, Any] = await self._call("log_settings")
        return settings

    async def update_log_settings(self, changes: dict[str, Any]) -> dict[str, Any]:
        settings: dict[str, Any] = await self._call("update_log_settings", changes)
        return settings

    # -- statistics and metrics ------------------------------------------------------------

    async def statistics(self, name: str = "", version: str = "") -> list[dict[str, Any]]:
        statistics: list[dict[str, Any]] = await self._call("statistics", name, version)
        return statistics

    async def version_statistics(self) -> list[VersionSnapshot]:
        versions: list[VersionSnapshot] = await self._call("version_statistics")
        return versions

    async def device_usage(self) -> dict[int, DeviceUsage]:
        usage: dict[int, DeviceUsage] = await self._call("device_usage")
        return usage

    async def custom_metrics(self) -> list[CustomMetric]:
        metrics: list[CustomMetric] = await self._call("custom_metrics")
        return metrics

    async def cache_statistics(self) -> CacheSnapshot | None:
        statistics: CacheSnapshot | None = await self._call("cache_statistics")
        return statistics


def _implements(api: RemoteInferenceAPI) -> InferenceAPI:
    return api  # mypy checks that the remote client implements the whole interface
