"""The two halves every layout runs: the engine host (models, workers, /metrics) and a protocol host (HTTP, gRPC)."""

# One process runs one of each on one loop, the front door reaching the engine through a LocalEngineLink; the
# supervisor runs the engine host in one forked process and a protocol host in each of the others, linked by the
# engine's channel. Either way the lifecycle's steps (geserve.lifecycle) are these hosts' methods.

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket

import grpc

from geserve.core.service import InferenceService
from geserve.frontdoor.arena import RequestArena, body_allocator
from geserve.frontdoor.link import EngineLink
from geserve.frontdoor.placement import Placement
from geserve.frontdoor.service import FrontDoor
from geserve.http.connections import Listening, ListeningHere, OpenConnections, ThisProcessOnly, TransportHooks
from geserve.http.direct import heap_body
from geserve.lifecycle import STOP_FLOOR_S
from geserve.listeners import Listener, grpc_server, http_listener, metrics_listener, stop_front_ends
from geserve.memory import freeze_startup_objects
from geserve.metrics.registry import create_registry
from geserve.settings import Settings
from geserve.workers.pool import InstancePools
from geserve.workers.runs import RunId

logger = logging.getLogger(__name__)


class EngineHost:
    """The InferenceService of a run with its instance pools (which call it back for BLS) and /metrics."""

    def __init__(self, settings: Settings, run: RunId, metrics_socket: socket.socket | None) -> None:
        self._settings = settings
        self.pools = InstancePools(settings.workers, run=run)
        metrics = settings.metrics if settings.metrics.enabled else None
        self.service = InferenceService(settings.server, settings.repository, self.pools, metrics=metrics)
        self.pools.caller = self.service  # python models' BLS requests
        self._metrics: Listener | None = None
        if metrics is not None:
            registry, collector = create_registry(self.service, metrics)
            self._metrics = metrics_listener(registry, collector.refresh, settings)
            self._metrics.socket = metrics_socket

    async def start(self) -> bool:
        """Load the startup models, start monitoring and /metrics; False, with the reason logged and everything
        stopped, when the server must exit."""
        settings = self._settings
        try:
            failures = await self.service.load_models()
        except FileNotFoundError as error:
            logger.error("%s", error)
            await self._abandon()
            return False
        if failures and settings.server.exit_on_error:
            logger.error("exiting: %d model(s) failed to load and --exit-on-error is true", len(failures))
            await self._abandon()
            return False
        # Python models' is_ready() and metrics, and NPU usage, are read from the workers periodically.
        self.service.start_monitoring(settings.metrics.interval_ms / 1000)
        # Before the listeners start, so the collection it begins with pauses no request.
        logger.debug("startup objects kept from the garbage collector: %d", freeze_startup_objects())
        if self._metrics is not None and not await self._metrics.start():
            await self.stop(0.0)
            return False
        return True

    def drain(self) -> None:
        """Step 1: not ready from now on, still serving; an ATC run may take an hour, so the loads waiting on
        one fail now."""
        self.service.start_draining()
        self.pools.stop_compiles()

    def refuse(self) -> None:
        """Step 2: admit no new request; those admitted finish."""
        self.service.stop_accepting()

    async def stop(self, timeout_s: float) -> None:
        """Step 4: /metrics closes, what is admitted finishes and the workers stop, within `timeout_s` (or the
        floor a worker gets to unload its model, when the deadline is spent)."""
        self.service.stop_accepting()
        if self._metrics is not None:
            await self._metrics.stop()
        await self.service.shutdown(max(timeout_s, STOP_FLOOR_S))

    def kill(self) -> None:
        """A second signal: every worker killed, its shared memory released, without waiting."""
        self.service.kill()

    async def _abandon(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
        await self.service.shutdown()


@dataclasses.dataclass(frozen=True, slots=True)
class Neighbours:
    """What the HTTP transport of one of several protocol processes shares with the others."""

    connections: OpenConnections
    listening: Listening


class ProtocolHost:
    """HTTP and gRPC over a front door that does each request's own work here and reaches the engine by `link`."""

    def __init__(
        self,
        settings: Settings,
        link: EngineLink,
        arena: RequestArena | None,
        run: RunId,
        *,
        http_socket: socket.socket | None,
        neighbours: Neighbours | None = None,
    ) -> None:
        self._settings = settings
        self._arena = arena
        self.front_door = FrontDoor(link, Placement(arena, run), settings.server.max_bytes_elements)
        self._listeners: list[Listener] = []
        self._grpc: grpc.aio.Server | None = None
        if settings.http.enabled:
            hooks = TransportHooks(
                heap_body if arena is None else body_allocator(arena),
                neighbours.connections if neighbours is not None else ThisProcessOnly(),
                neighbours.listening if neighbours is not None else ListeningHere(),
            )
            http = http_listener(self.front_door, settings, hooks)
            http.socket = http_socket
            # Among several, the supervisor says once for all of them where the server listens.
            http.announce = neighbours is None
            self._listeners.append(http)
        self._several = neighbours is not None

    def bind_grpc(self) -> bool:
        """Create the gRPC server, bound to its port (among several processes, each binds it with SO_REUSEPORT and
        the kernel spreads connections over them); False, with the error logged, when it cannot listen."""
        if not self._settings.grpc.enabled:
            return True
        grpc_settings = self._settings.grpc
        if self._several:
            grpc_settings = dataclasses.replace(grpc_settings, reuse_port=True)
        # A client's trace context is read where the engine continues it: in trace mode opentelemetry only.
        trace_context = self._settings.server.trace.get("trace_mode") == "opentelemetry"
        self._grpc = grpc_server(self.front_door, grpc_settings, trace_context=trace_context)
        return self._grpc is not None

    async def start(self) -> bool:
        """Start serving (gRPC bound by `bind_grpc` first); False, with the reason logged, if a listener fails."""
        if self._grpc is not None:
            await self._grpc.start()
            grpc_settings = self._settings.grpc
            level = logging.DEBUG if self._several else logging.INFO
            logger.log(level, "Started GRPCInferenceService at %s:%d", grpc_settings.address, grpc_settings.port)
        for listener in self._listeners:
            if not await listener.start():
                return False
        return True

    def ended(self) -> list[asyncio.Task[None]]:
        """The listeners' tasks: one that ends on its own means its server failed."""
        return [listener.task for listener in self._listeners if listener.task is not None]

    async def stop(self, grace_s: float) -> None:
        """Step 3: stop accepting everywhere at once, and let what is in flight finish within `grace_s`."""
        await stop_front_ends(self._listeners, self._grpc, grace_s)

    def close(self) -> None:
        """Release the request arena, once nothing is served from it."""
        if self._arena is not None:
            self._arena.close()
            self._arena = None
