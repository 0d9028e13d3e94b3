"""A protocol process: a protocol host over the engine's channel, stepped by the supervisor's words."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import Any

from geserve.core.log_control import LogControl
from geserve.frontdoor.arena import request_arena
from geserve.hosts import Neighbours, ProtocolHost
from geserve.http.connections import ListeningHere, ThisProcessOnly
from geserve.lifecycle import ShutdownPlan
from geserve.multiprocess.calls import LOG_SETTINGS_EVENT
from geserve.multiprocess.connection_count import SharedConnectionCount, SharedListening
from geserve.multiprocess.control import DRAIN, KILL, PING, PONG, READY, ControlLine, Launch
from geserve.multiprocess.remote import RemoteEngineLink
from geserve.settings import LoggingSettings

logger = logging.getLogger(__name__)

_CONNECT_RETRY_S = 0.02


def _apply_log_settings(name: str, value: Any) -> None:
    """The logging extension changed the engine's settings: this process logs the same way."""
    if name == LOG_SETTINGS_EVENT:
        LogControl(LoggingSettings(**value)).apply()


async def _connect(api: RemoteEngineLink, path: str, control: asyncio.Task[bytes]) -> bool:
    """Connect once the engine listens (it does after the startup models load); False if told to stop first."""
    while not control.done():
        try:
            await api.connect(path)
        except (FileNotFoundError, ConnectionRefusedError):
            await asyncio.sleep(_CONNECT_RETRY_S)
            continue
        return True
    return False


def _neighbours(launch: Launch) -> Neighbours:
    counts = launch.connection_counts
    if counts is None:
        return Neighbours(ThisProcessOnly(), ListeningHere())
    return Neighbours(SharedConnectionCount(counts, launch.index), SharedListening(counts, launch.index))


async def serve_protocol(launch: Launch, control: ControlLine) -> int:
    settings = launch.settings
    link = RemoteEngineLink(on_event=_apply_log_settings)
    word = asyncio.ensure_future(control.next_word())
    if not await _connect(link, launch.channel_path, word):
        return 0
    arena = request_arena(launch.arena, settings.server.request_arena_bytes)
    http_socket = socket.socket(fileno=launch.http_fd) if launch.http_fd >= 0 else None
    host = ProtocolHost(settings, link, arena, launch.run, http_socket=http_socket, neighbours=_neighbours(launch))
    plan = ShutdownPlan.of(settings.server)
    grace_s = 0.0  # what is in flight gets once accepting stops: nothing unless the supervisor drains this server
    try:
        if not host.bind_grpc() or not await host.start():
            return 1
        control.tell(READY)
        lost = asyncio.ensure_future(link.lost.wait())
        while True:
            await asyncio.wait([word, lost], return_when=asyncio.FIRST_COMPLETED)
            if lost.done() or word.result() != PING:
                break
            control.tell(PONG)  # from the loop itself: a loop stuck in a request cannot answer
            word = asyncio.ensure_future(control.next_word())
        if lost.done():
            logger.error("the engine closed its channel: exiting")
            return 1
        lost.cancel()
        if word.result() != DRAIN:
            # KILL, or the supervisor is gone (killed outright): nobody drains this server any more.
            return 1 if word.result() == KILL else 0
        deadlines = plan.begin()
        # Still accepting and serving until the drain ends: load balancers see the engine's not-ready and stop
        # sending.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(link.lost.wait(), deadlines.until_refuse())
        grace_s = deadlines.grace()
        return 0
    finally:
        await host.stop(grace_s)
        link.close()
        host.close()
