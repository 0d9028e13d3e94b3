"""A protocol process: HTTP and gRPC bytes (parsing, codecs, encoding) over the engine's InferenceAPI."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
from typing import Any

from geserve.core.log_control import LogControl
from geserve.frontdoor.arena import RequestArena, body_allocator, request_arena
from geserve.frontdoor.placement import Placement
from geserve.frontdoor.service import FrontDoor
from geserve.http.connections import ListeningHere, ThisProcessOnly, TransportHooks
from geserve.http.direct import heap_body
from geserve.listeners import Listener, grpc_server, http_listener, stop_front_ends
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


async def serve_protocol(launch: Launch, control: ControlLine) -> int:
    arena = request_arena(launch.arena, launch.settings.server.request_arena_bytes)
    link = RemoteEngineLink(on_event=_apply_log_settings)
    try:
        return await _serve(launch, control, link, arena)
    finally:
        if arena is not None:
            arena.close()


async def _serve(launch: Launch, control: ControlLine, link: RemoteEngineLink, arena: RequestArena | None) -> int:
    settings = launch.settings
    word = asyncio.ensure_future(control.next_word())
    if not await _connect(link, launch.channel_path, word):
        return 0
    api = FrontDoor(link, Placement(arena, launch.run), settings.server.max_bytes_elements)
    listeners: list[Listener] = []
    if settings.http.enabled:
        counts = launch.connection_counts
        hooks = TransportHooks(
            heap_body if arena is None else body_allocator(arena),
            SharedConnectionCount(counts, launch.index) if counts is not None else ThisProcessOnly(),
            SharedListening(counts, launch.index) if counts is not None else ListeningHere(),
        )
        http = http_listener(api, settings, hooks)
        http.socket = socket.socket(fileno=launch.http_fd)
        http.announce = False
        listeners.append(http)
    grpc = None
    if settings.grpc.enabled:
        # Each protocol process binds the gRPC port itself; the kernel spreads connections over them.
        grpc = grpc_server(api, dataclasses.replace(settings.grpc, reuse_port=True))
        if grpc is None:
            return 1
    grace_s = float(settings.server.exit_timeout_secs)  # for what is in flight once accepting stops
    try:
        if grpc is not None:
            await grpc.start()
            logger.debug("Started GRPCInferenceService at %s:%d", settings.grpc.address, settings.grpc.port)
        for listener in listeners:
            if not await listener.start():
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
            grace_s = 0.0
            return 1
        lost.cancel()
        if word.result() != DRAIN:
            # KILL, or the supervisor is gone (killed outright): nobody drains this server any more.
            grace_s = 0.0
            return 1 if word.result() == KILL else 0
        if settings.server.drain_delay_secs > 0:
            # Still accepting and serving: load balancers see the engine's not-ready and stop sending.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(link.lost.wait(), settings.server.drain_delay_secs)
        return 0
    finally:
        await stop_front_ends(listeners, grpc, grace_s)
        link.close()
