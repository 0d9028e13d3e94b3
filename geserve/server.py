"""Server lifecycle: load the repository, start the front-ends, serve, then shut down in reverse."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import uvicorn

from geserve.core.loader import LoadSettings
from geserve.core.service import InferenceService
from geserve.grpc.server import GrpcOptions, create_server
from geserve.http.app import DEFAULT_MAX_INPUT_SIZE, create_app

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """Everything the command line decides; defaults are tritonserver's."""

    model_repositories: list[Path] = field(default_factory=list)
    server_id: str = "triton"
    strict_readiness: bool = True
    exit_on_error: bool = True
    exit_timeout_secs: int = 30
    auto_complete: bool = True
    allow_http: bool = True
    http_address: str = "0.0.0.0"
    http_port: int = 8000
    http_max_input_size: int = DEFAULT_MAX_INPUT_SIZE
    allow_grpc: bool = True
    grpc: GrpcOptions = field(default_factory=GrpcOptions)
    allow_metrics: bool = True
    metrics_address: str = ""
    metrics_port: int = 8002
    log_verbose: int = 0
    log_level: int = logging.INFO


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn inside our own loop: signals belong to the Server lifecycle, not to uvicorn."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class Server:
    """Owns the InferenceService and the front-ends for one run."""

    def __init__(self, options: ServerOptions) -> None:
        self.options = options
        settings = LoadSettings(
            auto_complete=options.auto_complete,
            log_level=options.log_level,
            stop_timeout_s=float(options.exit_timeout_secs),
        )
        self.service = InferenceService(
            options.model_repositories, settings, options.server_id, options.strict_readiness
        )
        self._stop = asyncio.Event()

    def request_stop(self) -> None:
        self._stop.set()

    async def serve(self) -> int:
        """Run until SIGINT/SIGTERM; the exit status is non-zero when startup failed."""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self.request_stop)
        try:
            failures = await self.service.load_models()
        except FileNotFoundError as error:
            logger.error("%s", error)
            await self.service.shutdown()
            return 1
        if failures and self.options.exit_on_error:
            logger.error("exiting: %d model(s) failed to load and --exit-on-error is true", len(failures))
            await self.service.shutdown()
            return 1
        http = self._http_server() if self.options.allow_http else None
        http_task = asyncio.create_task(http.serve()) if http is not None else None
        grpc_server: grpc.aio.Server | None = None
        try:
            if self.options.allow_grpc:
                grpc_server = await self._start_grpc()
                if grpc_server is None:
                    return 1
            if http is not None and http_task is not None:
                # uvicorn exposes startup only as a flag.
                while not http.started and not http_task.done():  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
                if http_task.done():
                    logger.error(
                        "the HTTP service failed to start on %s:%d", self.options.http_address, self.options.http_port
                    )
                    return 1
                logger.info("Started HTTPService at %s:%d", self.options.http_address, self.options.http_port)
            waiters = [asyncio.create_task(self._stop.wait())] + ([http_task] if http_task else [])
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            waiters[0].cancel()
            logger.info("shutting down")
        finally:
            # Not ready first, then stop accepting and drain, then stop the workers.
            await self._shutdown(http, http_task, grpc_server)
        return 0

    async def _start_grpc(self) -> grpc.aio.Server | None:
        options = self.options.grpc
        try:
            server, _ = create_server(self.service, options)
            await server.start()
        except RuntimeError as error:
            logger.error("the gRPC service failed to start on %s:%d: %s", options.address, options.port, error)
            return None
        logger.info("Started GRPCInferenceService at %s:%d", options.address, options.port)
        return server

    async def _shutdown(
        self, http: uvicorn.Server | None, http_task: asyncio.Task[None] | None, grpc_server: grpc.aio.Server | None
    ) -> None:
        self.service.stop_accepting()
        if http is not None and http_task is not None:
            http.should_exit = True
        if grpc_server is not None:
            await grpc_server.stop(grace=float(self.options.exit_timeout_secs))
        if http_task is not None:
            with contextlib.suppress(BaseException):
                await http_task
        await self.service.shutdown()

    def _http_server(self) -> uvicorn.Server:
        options = self.options
        app = create_app(self.service, options.http_max_input_size)
        config = uvicorn.Config(
            app,
            host=options.http_address,
            port=options.http_port,
            lifespan="off",
            log_config=None,
            access_log=options.log_verbose > 0,
            timeout_graceful_shutdown=options.exit_timeout_secs,
            server_header=False,
        )
        return _EmbeddedUvicorn(config)
