"""The one-process layout: the engine host and a protocol host on one loop, taken through the lifecycle's steps."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from typing import Any

from geserve.core.local_link import LocalEngineLink
from geserve.frontdoor.arena import request_arena
from geserve.hosts import EngineHost, ProtocolHost
from geserve.lifecycle import Deadlines, ShutdownPlan, bind_ports, prepare_run
from geserve.settings import Settings
from geserve.workers.runs import RunId
from geserve.workers.shm import REQUEST_ARENA_ROLE

logger = logging.getLogger(__name__)


class Server:
    """One process serves everything: the front door checks each request against the engine's own models and
    hands it over without pickling; the shutdown plan's steps are taken here, in order."""

    def __init__(self, settings: Settings, run: RunId | None = None) -> None:
        self.settings = settings
        # This run's id, named by every segment any of its processes creates: a later server removes them once
        # this run is gone, and leaves those of live runs alone.
        self.run = run or RunId.current()
        self._plan = ShutdownPlan.of(settings.server)
        self._deadlines: Deadlines | None = None  # once a signal starts the shutdown
        self._stop = asyncio.Event()
        self._engine: EngineHost | None = None

    def request_stop(self) -> None:
        """First signal: the shutdown plan. Second signal: stop now."""
        if self._deadlines is not None:
            logger.warning("second signal: exiting without draining")
            if self._engine is not None:
                self._engine.kill()
            os._exit(1)
        self._deadlines = self._plan.begin()
        if self._engine is not None:
            self._engine.drain()
        self._stop.set()

    async def serve(self) -> int:
        """Run until SIGINT/SIGTERM; the exit status is non-zero when startup failed."""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self.request_stop)
        prepare_run(self.settings)
        ports = bind_ports(self.settings, check_grpc=False)
        if ports is None:
            return 1
        engine = self._engine = EngineHost(self.settings, self.run, ports.metrics)
        arena = request_arena(self.run.segment_name(f"{REQUEST_ARENA_ROLE}0"), self.settings.server.request_arena_bytes)
        protocol = ProtocolHost(self.settings, LocalEngineLink(engine.service), arena, self.run, http_socket=ports.http)
        try:
            if not protocol.bind_grpc():
                ports.close()
                await engine.stop(0.0)
                return 1
            started = await self._start_unless_stopped(engine)
            if not started:
                await protocol.stop(0.0)
                if started is None:  # a signal during startup: loads given up, the rest stopped by the plan's deadline
                    await engine.stop(self._deadlines.left() if self._deadlines is not None else 0.0)
                    return 0
                return 1
            status = await self._serve(engine, protocol)
        finally:
            protocol.close()
        return status

    async def _start_unless_stopped(self, engine: EngineHost) -> bool | None:
        """The engine's start (the startup models loaded); None when a signal came first: a model whose load or
        warmup never returns must not hold the server past its exit timeout."""
        starting = asyncio.ensure_future(engine.start())
        stopping = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait([starting, stopping], return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if starting.done():
            return starting.result()
        logger.info("a signal during startup: the loads in progress are given up")
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        return None

    async def _serve(self, engine: EngineHost, protocol: ProtocolHost) -> int:
        status = 0
        try:
            if not await protocol.start():
                status = 1
                return status
            waiters: list[asyncio.Future[Any]] = [asyncio.ensure_future(self._stop.wait()), *protocol.ended()]
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            waiters[0].cancel()
            if self._deadlines is not None and self._deadlines.until_refuse() > 0:
                logger.info("draining: not ready, still serving for %gs", self._plan.drain_s)
                await asyncio.sleep(self._deadlines.until_refuse())
            logger.info("shutting down")
        finally:
            deadlines = self._deadlines or self._plan.begin(drain=False)
            engine.refuse()
            await protocol.stop(deadlines.grace())
            await engine.stop(deadlines.left())
        return status
