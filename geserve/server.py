"""Server lifecycle: load the repository, start the front-ends, serve, then shut down in reverse."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import uvicorn

from geserve.core.instance_monitor import InstanceMonitor
from geserve.core.log_control import LogSettings
from geserve.core.restrictions import Restriction
from geserve.core.service import InferenceService, RepositoryControl
from geserve.core.shared_memory import SharedMemoryManager
from geserve.core.trace import TraceController
from geserve.grpc.server import GrpcOptions, create_server
from geserve.http.app import DEFAULT_MAX_INPUT_SIZE, create_app
from geserve.http.connections import ConnectionLimits, protocol_for, raise_descriptor_limit
from geserve.metrics.config import MetricsConfig
from geserve.metrics.registry import create_registry
from geserve.metrics.server import create_metrics_app
from geserve.settings import DEFAULT_ARENA_BYTES, WorkerSettings
from geserve.workers.pool import PoolFactory
from geserve.workers.shm import sweep_orphaned_segments

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """Everything the command line decides; defaults are tritonserver's."""

    model_repositories: list[Path] = field(default_factory=list)
    server_id: str = "triton"
    strict_readiness: bool = True
    exit_on_error: bool = True
    exit_timeout_secs: int = 30
    drain_delay_secs: int = 0
    warnings: tuple[str, ...] = ()  # about flags accepted but not honoured, logged at start
    auto_complete: bool = True
    allow_http: bool = True
    http_address: str = "0.0.0.0"
    http_port: int = 8000
    reuse_http_port: bool = False
    http_max_input_size: int = DEFAULT_MAX_INPUT_SIZE
    http_limits: ConnectionLimits = field(default_factory=ConnectionLimits)
    allow_grpc: bool = True
    grpc: GrpcOptions = field(default_factory=GrpcOptions)
    allow_metrics: bool = True
    metrics_address: str = "0.0.0.0"
    metrics_port: int = 8002
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    log_verbose: int = 0
    log_level: int = logging.INFO
    worker_arena_bytes: int = DEFAULT_ARENA_BYTES
    worker_pipeline_depth: int = 1
    device_ids: tuple[int, ...] = ()
    control: RepositoryControl = field(default_factory=RepositoryControl)
    allow_client_shm: bool = False
    http_restrictions: dict[str, Restriction] = field(default_factory=dict)
    grpc_restrictions: dict[str, Restriction] = field(default_factory=dict)
    log_settings: LogSettings = field(default_factory=LogSettings)
    trace_settings: dict[str, str | list[str]] = field(default_factory=dict)


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
    """Owns the InferenceService and the front-ends for one run."""

    def __init__(self, options: ServerOptions) -> None:
        self.options = options
        settings = WorkerSettings(
            auto_complete=options.auto_complete,
            log_level=options.log_level,
            stop_timeout_s=float(options.exit_timeout_secs),
            arena_bytes=options.worker_arena_bytes,
            pipeline_depth=options.worker_pipeline_depth,
            device_ids=options.device_ids,
        )
        self.service = InferenceService(
            options.model_repositories,
            PoolFactory(settings),
            options.server_id,
            options.strict_readiness,
            control=options.control,
            shared_memory=SharedMemoryManager(options.allow_client_shm),
            traces=TraceController(options.trace_settings),
            log_settings=options.log_settings,
            stop_timeout_s=float(options.exit_timeout_secs),
        )
        # The collector subscribes to versions as they load, so it exists before the models do.
        # Python models' is_ready() and metrics, and NPU usage, are read from the workers periodically.
        self.monitor = InstanceMonitor(self.service, options.metrics.interval_ms / 1000)
        self.registry = create_registry(self.service, options.metrics, self.monitor) if options.allow_metrics else None
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
        for warning in self.options.warnings:
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
        if failures and self.options.exit_on_error:
            logger.error("exiting: %d model(s) failed to load and --exit-on-error is true", len(failures))
            await self._release(listeners, grpc_server)
            return 1
        self.monitor.start()
        try:
            if grpc_server is not None:
                await grpc_server.start()
                logger.info("Started GRPCInferenceService at %s:%d", self.options.grpc.address, self.options.grpc.port)
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
            await self.monitor.stop()
            await self._stop_front_ends(listeners, grpc_server)
            await self.service.shutdown()
            self.service.shared_memory.close()
        return 0

    async def _drain(self) -> None:
        """Not ready at once, so load balancers stop routing here; what still arrives is served."""
        if self.options.drain_delay_secs <= 0:
            return
        self.service.start_draining()
        logger.info("draining: not ready, still serving for %ds", self.options.drain_delay_secs)
        await asyncio.sleep(self.options.drain_delay_secs)

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
        if not self.options.allow_grpc:
            return listeners, None
        options = self.options.grpc
        try:
            grpc_server, _ = create_server(self.service, options, self.options.grpc_restrictions)
        except RuntimeError:
            reason = "address already in use" if not options.reuse_port else "cannot bind"
            logger.error("the GRPCInferenceService cannot listen on %s:%d: %s", options.address, options.port, reason)
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
            await grpc_server.stop(grace=float(self.options.exit_timeout_secs))
        await asyncio.gather(*(listener.stop() for listener in listeners))

    def _listeners(self) -> list[_Listener]:
        options = self.options
        listeners = []
        if options.allow_http:
            app = create_app(self.service, options.http_max_input_size, options.http_restrictions)
            listeners.append(
                _Listener(
                    "HTTPService",
                    options.http_address,
                    options.http_port,
                    self._uvicorn("HTTPService", app, options.http_address, options.http_port),
                    reuse_port=options.reuse_http_port,
                )
            )
        if self.registry is not None:
            metrics_app = create_metrics_app(self.registry)
            server = self._uvicorn("Metrics Service", metrics_app, options.metrics_address, options.metrics_port)
            listeners.append(_Listener("Metrics Service", options.metrics_address, options.metrics_port, server))
        return listeners

    def _uvicorn(self, name: str, app: Any, host: str, port: int) -> _EmbeddedUvicorn:
        limits = self.options.http_limits
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            http=protocol_for(name, limits),
            timeout_keep_alive=limits.keep_alive_s,
            lifespan="off",
            log_config=None,
            access_log=self.options.log_verbose > 0,
            timeout_graceful_shutdown=self.options.exit_timeout_secs,
            server_header=False,
            proxy_headers=False,  # one middleware layer less per request; deployments terminate proxies upstream
        )
        return _EmbeddedUvicorn(config)
