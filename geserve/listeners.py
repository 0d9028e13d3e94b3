"""The listening side shared by every process layout: bound sockets, embedded uvicorn servers, the gRPC server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import Any, cast

import grpc
import uvicorn
from prometheus_client.registry import CollectorRegistry

from geserve.core.api import InferenceAPI
from geserve.grpc.server import create_server
from geserve.http.app import create_app
from geserve.http.connections import Listening, ListeningHere, TransportHooks, protocol_for
from geserve.http.direct import InPlaceBodies
from geserve.metrics.server import create_metrics_app
from geserve.settings import GrpcSettings, Settings
from geserve.sockets import HTTP_SERVICE, METRICS_SERVICE, bind_socket

logger = logging.getLogger(__name__)


# How long a stopping listener waits for the other processes holding its socket to close theirs.
LISTENER_CLOSE_WAIT_S = 2.0

# uvicorn's own lifecycle lines, one set per listener: with the HTTP and metrics listeners in one process they read as
# two servers, and geserve says which service started where (Listener.start) and when it shuts down.
_UVICORN_LIFECYCLE = frozenset({"Started server process [%d]", "Finished server process [%d]", "Shutting down"})


class _WithoutUvicornLifecycle(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg not in _UVICORN_LIFECYCLE


def _quiet_uvicorn_lifecycle() -> None:
    uvicorn_logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(existing, _WithoutUvicornLifecycle) for existing in uvicorn_logger.filters):
        uvicorn_logger.addFilter(_WithoutUvicornLifecycle())


class EmbeddedUvicorn(uvicorn.Server):
    """uvicorn inside our own loop: signals belong to the process's lifecycle, not to uvicorn. On shutdown it
    closes its connections only once the listening socket is closed in every process that holds it: a client
    whose connection closes reconnects at once, and a connection queued on a socket no process accepts from any
    more is reset when the socket closes, where it should have been refused."""

    def __init__(self, config: uvicorn.Config, listening: Listening | None = None) -> None:
        super().__init__(config)
        self.listening: Listening = listening or ListeningHere()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.listening.opened()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()  # stop accepting here (uvicorn's own shutdown does it again, harmlessly)
        for sock in sockets or []:
            sock.close()
        self.listening.closed()
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + LISTENER_CLOSE_WAIT_S
        # Other processes clear their flag in shared memory: there is no event here to wait on.
        while not self.listening.closed_everywhere() and loop.time() < give_up_at:  # noqa: ASYNC110
            await asyncio.sleep(0.005)
        await super().shutdown(sockets)


@dataclass(slots=True)
class Listener:
    """One uvicorn server (HTTP or metrics) running as a task on the loop."""

    name: str
    address: str
    port: int
    server: EmbeddedUvicorn
    reuse_port: bool = False
    socket: socket.socket | None = None  # bound before the models load; uvicorn listens on it
    task: asyncio.Task[None] | None = None
    # Whether its start is logged at INFO: a protocol process among several leaves that to the supervisor, which
    # says it once for all of them.
    announce: bool = True

    def bind(self) -> None:
        self.socket = bind_socket(self.address, self.port, self.reuse_port)

    async def start(self) -> bool:
        sockets = [self.socket] if self.socket is not None else None
        self.task = asyncio.create_task(self.server.serve(sockets=sockets))
        # uvicorn exposes startup only as a flag.
        while not self.server.started and not self.task.done():  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        if self.task.done():
            logger.error("the %s failed to start on %s:%d", self.name, self.address, self.port)
            return False
        logger.log(
            logging.INFO if self.announce else logging.DEBUG, "Started %s at %s:%d", self.name, self.address, self.port
        )
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


def http_listener(api: InferenceAPI, settings: Settings, hooks: TransportHooks | None = None) -> Listener:
    """The HTTP/REST listener over `api` (not bound); `hooks` for a protocol process among several."""
    http = settings.http
    app = create_app(api, http)
    in_place = app.reads_body_in_place
    server = embedded_uvicorn(
        settings, HTTP_SERVICE, app, http.address, http.port, reads_in_place=in_place, hooks=hooks
    )
    return Listener(HTTP_SERVICE, http.address, http.port, server, reuse_port=http.reuse_port)


def metrics_listener(
    registry: CollectorRegistry, refresh: Callable[[], Awaitable[None]], settings: Settings
) -> Listener:
    """The Prometheus listener over `registry`, refreshed before each scrape (not bound)."""
    metrics = settings.metrics
    app = create_metrics_app(registry, refresh)
    server = embedded_uvicorn(settings, METRICS_SERVICE, app, metrics.address, metrics.port)
    return Listener(METRICS_SERVICE, metrics.address, metrics.port, server)


def grpc_server(api: InferenceAPI, settings: GrpcSettings, *, trace_context: bool = False) -> grpc.aio.Server | None:
    """The gRPC server over `api`, bound (not started); None, with the error logged, when the port is taken.
    `trace_context`: ModelInfer reads clients' trace contexts (trace mode opentelemetry)."""
    try:
        server, _ = create_server(api, settings, trace_context=trace_context)
    except RuntimeError:
        reason = "address already in use" if not settings.reuse_port else "cannot bind"
        logger.error("the GRPCInferenceService cannot listen on %s:%d: %s", settings.address, settings.port, reason)
        return None
    return server


def embedded_uvicorn(
    settings: Settings,
    name: str,
    app: Any,
    host: str,
    port: int,
    *,
    reads_in_place: InPlaceBodies | None = None,
    hooks: TransportHooks | None = None,
) -> EmbeddedUvicorn:
    http = settings.http
    _quiet_uvicorn_lifecycle()
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=cast(
            Any, protocol_for(name, http, reads_in_place, hooks)
        ),  # a factory: uvicorn calls it for each connection
        timeout_keep_alive=http.keep_alive_s,
        lifespan="off",
        log_config=None,
        access_log=settings.server.logging.log_verbose_level > 0,
        timeout_graceful_shutdown=settings.server.exit_timeout_secs,
        server_header=False,
        proxy_headers=False,  # one middleware layer less per request; deployments terminate proxies upstream
    )
    return EmbeddedUvicorn(config, hooks.listening if hooks is not None else None)


async def stop_front_ends(listeners: list[Listener], grpc: grpc.aio.Server | None, grace_s: float) -> None:
    """Stop accepting everywhere at once, then let what is in flight finish (within `grace_s`). The front-ends
    wait side by side: one after the other, a request stuck on each would spend the grace twice."""
    for listener in listeners:
        # uvicorn's own wait for its requests in flight ends with the grace, not with the --exit-timeout-secs it was
        # configured with: the shutdown plan's deadline holds for everything.
        # (uvicorn annotates it an int; it hands it to asyncio.wait_for, which takes any number of seconds.)
        listener.server.config.timeout_graceful_shutdown = grace_s  # type: ignore[assignment]
        listener.server.should_exit = True
    stopping = [listener.stop() for listener in listeners]
    if grpc is not None:
        stopping.append(grpc.stop(grace=grace_s))
    await asyncio.gather(*stopping)
