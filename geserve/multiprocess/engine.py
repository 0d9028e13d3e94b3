"""The engine process: the one InferenceService and /metrics, serving the protocol processes over its channel."""

from __future__ import annotations

import asyncio
import logging
import os
import socket

from geserve.batching.lifecycle import STOP_FLOOR_S
from geserve.core.service import InferenceService
from geserve.listeners import Listener, metrics_listener
from geserve.metrics.registry import create_registry
from geserve.multiprocess.control import DRAIN, KILL, READY, REFUSE, STOP, ControlLine, Launch
from geserve.multiprocess.endpoint import EngineEndpoint
from geserve.server import create_service, start_service
from geserve.workers.pool import InstancePools

logger = logging.getLogger(__name__)


async def serve_engine(launch: Launch, control: ControlLine) -> int:
    settings = launch.settings
    pools = InstancePools(settings.workers, run=launch.run)
    service = create_service(settings, launch.run, pools)
    endpoint = EngineEndpoint(service)
    metrics: Listener | None = None
    if settings.metrics.enabled:
        registry, collector = create_registry(service, settings.metrics)
        metrics = metrics_listener(registry, collector.refresh, settings)
        metrics.socket = socket.socket(fileno=launch.metrics_fd)
    loop = asyncio.get_running_loop()
    stop_by: float | None = None  # when the shutdown must be over, once the supervisor starts it
    supervised = True  # False once the supervisor is gone: nobody waits for a drain any more
    if not await start_service(service, settings):
        if metrics is not None:
            metrics.close()
        await service.shutdown()
        return 1
    try:
        if metrics is not None and not await metrics.start():
            return 1
        await endpoint.start(launch.channel_path)
        control.tell(READY)
        while True:
            word = await control.next_word()
            if word == DRAIN:
                # The drain window, then --exit-timeout-secs for everything still in flight, the workers' stop
                # included: the protocol processes spend their part of it first.
                server = settings.server
                stop_by = loop.time() + server.drain_delay_secs + server.exit_timeout_secs
                # Readiness is the engine's: every protocol process answers not ready from now on.
                service.start_draining()
                pools.stop_compiles()  # an ATC run may take an hour: the loads waiting on one fail now
                logger.info("draining: not ready, still serving")
            elif word == REFUSE:
                service.stop_accepting()
            elif word == KILL:
                service.kill()
                os._exit(1)
            elif word in (STOP, b""):
                supervised = word == STOP
                break
        logger.info("shutting down")
    finally:
        service.stop_accepting()
        await endpoint.stop()
        if metrics is not None:
            await metrics.stop()
        if not supervised:
            stop_by = loop.time()
        timeout_s = None if stop_by is None else max(stop_by - loop.time(), STOP_FLOOR_S)
        await _shut_down(service, control if supervised else None, timeout_s)
    return 0


async def _shut_down(service: InferenceService, control: ControlLine | None, timeout_s: float | None) -> None:
    """The service's shutdown, unless meanwhile the supervisor goes (killed: nothing would stop this process while a
    stuck model holds the shutdown) or says KILL (a second signal): then the workers are killed, and the process
    exits at once."""
    shutdown = asyncio.ensure_future(service.shutdown(timeout_s))
    if control is None:
        await shutdown
        return
    gone = asyncio.ensure_future(_supervisor_gone(control))
    await asyncio.wait([shutdown, gone], return_when=asyncio.FIRST_COMPLETED)
    if shutdown.done():
        gone.cancel()
        shutdown.result()
        return
    logger.warning("%s during the shutdown: killing the workers", gone.result())
    service.kill()
    os._exit(1)


async def _supervisor_gone(control: ControlLine) -> str:
    while True:
        word = await control.next_word()
        if word == b"":
            return "the supervisor is gone"
        if word == KILL:
            return "second signal"
