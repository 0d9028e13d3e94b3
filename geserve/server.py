"""Server lifecycle: load the repository, start the front-ends, serve, then shut down in reverse."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import Any

import grpc

from geserve.batching.lifecycle import STOP_FLOOR_S
from geserve.core.local_link import LocalEngineLink
from geserve.core.service import InferenceService
from geserve.frontdoor.arena import body_allocator, request_arena
from geserve.frontdoor.placement import Placement
from geserve.frontdoor.service import FrontDoor
from geserve.http.connections import TransportHooks
from geserve.listeners import Listener, grpc_server, http_listener, metrics_listener, stop_front_ends
from geserve.memory import freeze_startup_objects
from geserve.metrics.registry import create_registry
from geserve.settings import Settings
from geserve.sockets import raise_descriptor_limit
from geserve.workers.pool import InstancePools
from geserve.workers.runs import RunId, sweep_orphaned_segments
from geserve.workers.shm import REQUEST_ARENA_ROLE

logger = logging.getLogger(__name__)


def create_service(settings: Settings, run: RunId, pools: InstancePools | None = None) -> InferenceService:
    """The InferenceService of a run, its instance pools' factory wired in (workers call it back for BLS)."""
    pools = pools or InstancePools(settings.workers, run=run)
    metrics = settings.metrics if settings.metrics.enabled else None
    service = InferenceService(settings.server, settings.repository, pools, metrics=metrics)
    pools.caller = service  # python models' BLS requests
    return service


async def start_service(service: InferenceService, settings: Settings) -> bool:
    """Load the startup models and start monitoring; False, with the reason logged, when the server must exit."""
    try:
        failures = await service.load_models()
    except FileNotFoundError as error:
        logger.error("%s", error)
        return False
    if failures and settings.server.exit_on_error:
        logger.error("exiting: %d model(s) failed to load and --exit-on-error is true", len(failures))
        return False
    # Python models' is_ready() and metrics, and NPU usage, are read from the workers periodically.
    service.start_monitoring(settings.metrics.interval_ms / 1000)
    # Before the listeners start, so the collection it begins with pauses no request.
    logger.debug("startup objects kept from the garbage collector: %d", freeze_startup_objects())
    return True


class Server:
    """Owns the InferenceService and the front-ends for one run: builds each layer from its settings
    section and hands the core its instance pools' factory."""

    def __init__(self, settings: Settings, run: RunId | None = None) -> None:
        self.settings = settings
        # This run's id, made in the top-level process (here, or the supervisor that started this engine) and
        # named by every segment any of its processes creates: a later server removes them once this run is
        # gone, and leaves those of live runs alone.
        self.run = run or RunId.current()
        self._pools = InstancePools(settings.workers, run=self.run)
        self.service = create_service(settings, self.run, self._pools)
        self._metrics_registry = create_registry(self.service, settings.metrics) if settings.metrics.enabled else None
        # The front-ends' API: each request's own work here, its scheduling in the engine, in this one process.
        self._arena = request_arena(
            self.run.segment_name(f"{REQUEST_ARENA_ROLE}0"), settings.server.request_arena_bytes
        )
        self.front_door = FrontDoor(
            LocalEngineLink(self.service), Placement(self._arena, self.run), settings.server.max_bytes_elements
        )
        self._stop = asyncio.Event()

    def request_stop(self) -> None:
        """First signal: graceful shutdown. Second signal: stop now."""
        if self._stop.is_set():
            logger.warning("second signal: exiting without draining")
            self.service.kill()
            os._exit(1)
        self._pools.stop_compiles()  # an ATC run may take an hour: the loads waiting on one fail now
        self._stop.set()

    async def serve(self) -> int:
        """Run until SIGINT/SIGTERM; the exit status is non-zero when startup failed."""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self.request_stop)
        raise_descriptor_limit()
        for warning in self.settings.server.warnings:
            logger.warning("%s", warning)
        orphans = await asyncio.to_thread(sweep_orphaned_segments)
        if orphans:
            logger.warning("removed %d shared-memory segment(s) left by geserve servers that were killed", len(orphans))
        # Every port is bound before any model loads: a taken port is a clear error at once, with
        # nothing started that would need cleaning up.
        bound = self._bind_front_ends()
        if bound is None:
            return 1
        listeners, grpc_server = bound
        if not await start_service(self.service, self.settings):
            await self._release(listeners, grpc_server)
            return 1
        try:
            if grpc_server is not None:
                await grpc_server.start()
                grpc_settings = self.settings.grpc
                logger.info("Started GRPCInferenceService at %s:%d", grpc_settings.address, grpc_settings.port)
            for listener in listeners:
                if not await listener.start():
                    return 1
            waiters: list[asyncio.Future[Any]] = [asyncio.ensure_future(self._stop.wait())]
            waiters += [listener.task for listener in listeners if listener.task is not None]
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            waiters[0].cancel()
            if self._stop.is_set():
                await self._drain()
            logger.info("shutting down")
        finally:
            # Not ready, stop accepting, finish what is in flight, then stop the workers: all of it within
            # --exit-timeout-secs, as Triton's "timeout when exiting to wait for in-flight inferences to finish".
            deadline = loop.time() + self.settings.server.exit_timeout_secs
            self.service.stop_accepting()
            await self._stop_front_ends(listeners, grpc_server)
            await self.service.shutdown(max(deadline - loop.time(), STOP_FLOOR_S))
            if self._arena is not None:
                self._arena.close()
        return 0

    async def _drain(self) -> None:
        """Not ready at once, so load balancers stop routing here; what still arrives is served."""
        delay = self.settings.server.drain_delay_secs
        if delay <= 0:
            return
        self.service.start_draining()
        logger.info("draining: not ready, still serving for %ds", delay)
        await asyncio.sleep(delay)

    def _bind_front_ends(self) -> tuple[list[Listener], grpc.aio.Server | None] | None:
        """Bind the HTTP, metrics and gRPC ports (not yet listening); None, with the error logged, if one is taken."""
        listeners: list[Listener] = []
        try:
            for listener in self._listeners():
                listener.bind()
                listeners.append(listener)
        except OSError as error:
            where = f"{listener.address}:{listener.port}"
            logger.error("the %s cannot listen on %s: %s", listener.name, where, error.strerror)
            for bound in listeners:
                bound.close()
            return None
        if not self.settings.grpc.enabled:
            return listeners, None
        grpc = grpc_server(self.front_door, self.settings.grpc)
        if grpc is None:
            for bound in listeners:
                bound.close()
            return None
        return listeners, grpc

    async def _release(self, listeners: list[Listener], grpc_server: grpc.aio.Server | None) -> None:
        for listener in listeners:
            listener.close()
        if grpc_server is not None:
            await grpc_server.stop(None)
        await self.service.shutdown()
        if self._arena is not None:
            self._arena.close()

    async def _stop_front_ends(self, listeners: list[Listener], grpc_server: grpc.aio.Server | None) -> None:
        await stop_front_ends(listeners, grpc_server, float(self.settings.server.exit_timeout_secs))

    def _listeners(self) -> list[Listener]:
        listeners = []
        if self.settings.http.enabled:
            hooks = TransportHooks(body_allocator(self._arena)) if self._arena is not None else None
            listeners.append(http_listener(self.front_door, self.settings, hooks))
        if self._metrics_registry is not None:
            registry, collector = self._metrics_registry
            listeners.append(metrics_listener(registry, collector.refresh, self.settings))
        return listeners
