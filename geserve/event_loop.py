"""The event loop every geserve process runs on: uvloop where it is installed, else asyncio's own."""

from __future__ import annotations

import asyncio


def loop_factory() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop
