"""The engine process: the engine host, serving the protocol processes over its channel, stepped by the supervisor."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket

from geserve.hosts import EngineHost
from geserve.lifecycle import Deadlines, ShutdownPlan
from geserve.multiprocess.control import DRAIN, KILL, READY, REFUSE, STOP, ControlLine, Launch
from geserve.multiprocess.endpoint import EngineEndpoint

logger = logging.getLogger(__name__)


async def serve_engine(launch: Launch, control: ControlLine) -> int:
    settings = launch.settings
    metrics_socket = socket.socket(fileno=launch.metrics_fd) if launch.metrics_fd >= 0 else None
    engine = EngineHost(settings, launch.run, metrics_socket)
    endpoint = EngineEndpoint(engine.service)
    plan = ShutdownPlan.of(settings.server)
    deadlines: Deadlines | None = None  # once the supervisor starts the shutdown
    supervised = True  # False once the supervisor is gone: nobody waits for a drain any more
    # The supervisor's word is read while the startup models load: a signal then gives their loads up (a warmup
    # that never returns must not hold the server past its exit timeout).
    first_word = asyncio.ensure_future(control.next_word())
    starting = asyncio.ensure_future(engine.start())
    await asyncio.wait([starting, first_word], return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        return await _stopped_while_starting(engine, starting, first_word.result(), control, plan)
    if not starting.result():
        first_word.cancel()
        return 1
    pending: asyncio.Future[bytes] | None = first_word
    try:
        await endpoint.start(launch.channel_path)
        control.tell(READY)
        while True:
            word = await pending if pending is not None else await control.next_word()
            pending = None
            if word == DRAIN:
                # The protocol processes compute the same deadlines from the same word: they spend their part of
                # --exit-timeout-secs first, then the supervisor says STOP.
                deadlines = plan.begin()
                # Readiness is the engine's: every protocol process answers not ready from now on.
                engine.drain()
                logger.info("draining: not ready, still serving")
            elif word == REFUSE:
                engine.refuse()
            elif word == KILL:
                engine.kill()
                os._exit(1)
            elif word in (STOP, b""):
                supervised = word == STOP
                break
        logger.info("shutting down")
    finally:
        engine.refuse()
        await endpoint.stop()
        # Without the supervisor nobody waits any more: the workers get only their floor.
        timeout_s = (deadlines or plan.begin(drain=False)).left() if supervised else 0.0
        await _shut_down(engine, control if supervised else None, timeout_s)
    return 0


async def _stopped_while_starting(
    engine: EngineHost, starting: asyncio.Future[bool], word: bytes, control: ControlLine, plan: ShutdownPlan
) -> int:
    """The supervisor said DRAIN (or KILL, or went) before the startup models loaded: their loads are given up and
    the workers stopped; then, as after any shutdown, the supervisor's STOP is awaited."""
    logger.info("stopped during startup: the loads in progress are given up")
    starting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await starting
    if word == KILL:
        engine.kill()
        os._exit(1)
    supervised = word != b""
    await _shut_down(engine, control if supervised else None, plan.begin(drain=False).left())
    while supervised and (word := await control.next_word()) not in (STOP, b""):
        if word == KILL:
            os._exit(1)
    return 0


async def _shut_down(engine: EngineHost, control: ControlLine | None, timeout_s: float) -> None:
    """The engine host's stop, unless meanwhile the supervisor goes (killed: nothing would stop this process while a
    stuck model holds the shutdown) or says KILL (a second signal): then the workers are killed, and the process
    exits at once."""
    shutdown = asyncio.ensure_future(engine.stop(timeout_s))
    if control is None:
        await shutdown
        return
    gone = asyncio.ensure_future(_supervisor_gone(control))
    await asyncio.wait([shutdown, gone], return_when=asyncio.FIRST_COMPLETED)
    if shutdown.done():
        gone.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await gone  # its read of the control line ends before anything reads it again
        shutdown.result()
        return
    logger.warning("%s during the shutdown: killing the workers", gone.result())
    engine.kill()
    os._exit(1)


async def _supervisor_gone(control: ControlLine) -> str:
    while True:
        word = await control.read_word()
        if word == b"":
            return "the supervisor is gone"
        if word == KILL:
            return "second signal"
        # Another word (the STOP that follows the protocol processes' exit, during a stop begun at startup) is
        # for whoever reads the line after this stops listening: dropped, it would be waited for in vain.
        control.keep(word)
