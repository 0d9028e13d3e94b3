"""The engine process: the one InferenceService and /metrics, serving the protocol processes over its channel."""

from __future__ import annotations

import logging
import os
import socket

from geserve.listeners import Listener, metrics_listener
from geserve.metrics.registry import create_registry
from geserve.multiprocess.control import DRAIN, KILL, READY, REFUSE, STOP, ControlLine, Launch
from geserve.multiprocess.endpoint import EngineEndpoint
from geserve.server import create_service, start_service
from geserve.workers.pool import PoolFactory

logger = logging.getLogger(__name__)


async def serve_engine(launch: Launch, control: ControlLine) -> int:
    settings = launch.settings
    pools = PoolFactory(settings.workers, run=launch.run)
    service = create_service(settings, launch.run, pools)
    # Request tensors in the protocol processes' arenas are tracked with the pipeline outputs: a worker is
    # given them in place.
    endpoint = EngineEndpoint(service, pools.mapped)
    metrics: Listener | None = None
    if settings.metrics.enabled:
        registry, collector = create_registry(service, settings.metrics)
        metrics = metrics_listener(registry, collector.refresh, settings)
        metrics.socket = socket.socket(fileno=launch.metrics_fd)
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
                break
        logger.info("shutting down")
    finally:
        service.stop_accepting()
        await endpoint.stop()
        if metrics is not None:
            await metrics.stop()
        await service.shutdown()
    return 0
