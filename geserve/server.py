"""Server lifecycle: load the repository, start the front-ends, serve, then shut down in reverse."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, cast

import grpc
import uvicorn

from geserve.core.service import InferenceService
from geserve.grpc.server import create_server
from geserve.http.app import create_app
from geserve.http.connections import protocol_for, raise_descriptor_limit
from geserve.http.direct import InPlaceBodies
from geserve.memory import freeze_startup_objects
from geserve.metrics.registry import create_registry
from geserve.metrics.server import create_metrics_app
from geserve.settings import Settings
from geserve.workers.pool import PoolFactory
from geserve.workers.runs import RunId, sweep_orphaned_segments

logger = logging.getLogger(__name__)


def _bind(address: str, port: int, reuse_port: bool) -> socket.socket:
    """A TCP socket bound to the address (not yet listening, so connections are refused until it serves)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((address, port))
    except OSError:
        sock.close()
        raise
    return sock


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn inside our own loop: signals belong to the Server lifecycle, not to uvicorn."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


@dataclass(slots=True)
class _Listener:
    """One uvicorn server (HTTP or metrics) running as a task on the loop."""

    name: str
    address: str
    port: int
    server: _EmbeddedUvicorn
    reuse_port: bool = False
    socket: socket.socket | None = None  # bound before the models load; uvicorn listens on it
    task: asyncio.Task[None] | None = None

    async def start(self) -> bool:
        sockets = [self.socket] if self.socket is not None else None
        self.task = asyncio.create_task(self.server.serve(sockets=sockets))
        # uvicorn exposes startup only as a flag.
        while not self.server.started and not self.task.done():  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        if self.task.done():
            logger.error("the %s failed to start on %s:%d", self.name, self.address, self.port)
            return False
        logger.info("Started %s at %s:%d", self.name, self.address, self.port)
        return True

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            with contextlib.suppress(BaseException):
                await self.task
        self.close()

    def close(self) -> None:
        if self.socket is not None:
            self.socket.close()


class Server:
    """Owns the InferenceService and the front-ends for one run: builds each layer from its settings
    section and hands the core its instance pools' factory."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        # This run's id, made here, in the top-level process, and named by every segment any of its processes
        # creates: a later server removes them once this run is gone, and leaves those of live runs alone.
        self.run = RunId.current()
        pools = PoolFactory(settings.workers, run=self.run)
        metrics = settings.metrics if settings.metrics.enabled else None
        self.service = InferenceService(settings.server, settings.repository, pools, metrics=metrics)
        pools.caller = self.service  # python models' BLS requests
        self._metrics_registry = create_registry(self.service, settings.metrics) if settings.metrics.enabled else None
        self._stop = asyncio.Event()

    def request_stop(self) -> None:
        """First signal: graceful shutdown. Second signal: stop now."""
        if self._stop.is_set():
            logger.warning("second signal: exiting without draining")
            self.service.kill()
            os._exit(1)
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
        try:
            failures = await self.service.load_models()
        except FileNotFoundError as error:
            logger.error("%s", error)
            await self._release(listeners, grpc_server)
            return 1
        if failures and self.settings.server.exit_on_error:
            logger.error("exiting: %d model(s) failed to load and --exit-on-error is true", len(failures))
            await self._release(listeners, grpc_server)
            return 1
        # Python models' is_ready() and metrics, and NPU usage, are read from the workers periodically.
        self.service.start_monitoring(self.settings.metrics.interval_ms / 1000)
        # Before the listeners start, so the collection it begins with pauses no request.
        logger.debug("startup objects kept from the garbage collector: %d", freeze_startup_objects())
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
            # Not ready, stop accepting, finish what is in flight, then stop the workers.
            self.service.stop_accepting()
            await self._stop_front_ends(listeners, grpc_server)
            await self.service.shutdown()
        return 0

    async def _drain(self) -> None:
        """Not ready at once, so load balancers stop routing here; what still arrives is served."""
        delay = self.settings.server.drain_delay_secs
        if delay <= 0:
            return
        self.service.start_draining()
        logger.info("draining: not ready, still serving for %ds", delay)
        await asyncio.sleep(delay)

    def _bind_front_ends(self) -> tuple[list[_Listener], grpc.aio.Server | None] | None:
        """Bind the HTTP, metrics and gRPC ports (not yet listening); None, with the error logged, if one is taken."""
        listeners: list[_Listener] = []
        try:
            for listener in self._listeners():
                listener.socket = _bind(listener.address, listener.port, listener.reuse_port)
                listeners.append(listener)
        except OSError as error:
            where = f"{listener.address}:{listener.port}"
            logger.error("the %s cannot listen on %s: %s", listener.name, where, error.strerror)
            for bound in listeners:
                bound.close()
            return None
        grpc_settings = self.settings.grpc
        if not grpc_settings.enabled:
            return listeners, None
        try:
            grpc_server, _ = create_server(self.service, grpc_settings)
        except RuntimeError:
            reason = "address already in use" if not grpc_settings.reuse_port else "cannot bind"
            address, port = grpc_settings.address, grpc_settings.port
            logger.error("the GRPCInferenceService cannot listen on %s:%d: %s", address, port, reason)
            for bound in listeners:
                bound.close()
            return None
        return listeners, grpc_server

    async def _release(self, listeners: list[_Listener], grpc_server: grpc.aio.Server | None) -> None:
        for listener in listeners:
            listener.close()
        if grpc_server is not None:
            await grpc_server.stop(None)
        await self.service.shutdown()

    async def _stop_front_ends(self, listeners: list[_Listener], grpc_server: grpc.aio.Server | None) -> None:
        for listener in listeners:
            listener.server.should_exit = True
        if grpc_server is not None:
            await grpc_server.stop(grace=float(self.settings.server.exit_timeout_secs))
        await asyncio.gather(*(listener.stop() for listener in listeners))

    def _listeners(self) -> list[_Listener]:
        http, metrics = self.settings.http, self.settings.metrics
        listeners = []
        if http.enabled:
            app = create_app(self.service, http)
            server = self._uvicorn("HTTPService", app, http.address, http.port, app.reads_body_in_place)
            listeners.append(_Listener("HTTPService", http.address, http.port, server, reuse_port=http.reuse_port))
        if self._metrics_registry is not None:
            registry, collector = self._metrics_registry
            metrics_app = create_metrics_app(registry, collector.refresh)
            server = self._uvicorn("Metrics Service", metrics_app, metrics.address, metrics.port)
            listeners.append(_Listener("Metrics Service", metrics.address, metrics.port, server))
        return listeners

    def _uvicorn(
        self, name: str, app: Any, host: str, port: int, reads_in_place: InPlaceBodies | None = None
    ) -> _EmbeddedUvicorn:
        http = self.settings.http
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            http=cast(Any, protocol_for(name, http, reads_in_place)),  # a factory: uvicorn calls it for each connection
            timeout_keep_alive=http.keep_alive_s,
            lifespan="off",
            log_config=None,
            access_log=self.settings.server.logging.log_verbose_level > 0,
            timeout_graceful_shutdown=self.settings.server.exit_timeout_secs,
            server_header=False,
            proxy_headers=False,  # one middleware layer less per request; deployments terminate proxies upstream
        )
        return _EmbeddedUvicorn(config)
