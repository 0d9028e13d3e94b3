"""The engine's control line while it stops: a word its shutdown listener reads but does not act on is kept for the
next reader, so a STOP that arrives during a stop begun at startup is not waited for in vain."""

from __future__ import annotations

import asyncio
import socket

from geserve.multiprocess.control import KILL, STOP, ControlLine
from geserve.multiprocess.engine import _supervisor_gone


async def _line() -> tuple[ControlLine, socket.socket, asyncio.StreamWriter]:
    ours, theirs = socket.socketpair()
    reader, writer = await asyncio.open_unix_connection(sock=theirs)
    return ControlLine(reader, writer), ours, writer


async def test_a_stop_heard_by_the_shutdown_listener_reaches_the_next_reader() -> None:
    control, supervisor, writer = await _line()
    try:
        listening = asyncio.ensure_future(_supervisor_gone(control))
        supervisor.sendall(STOP + b"\n")  # the protocol processes are gone while the engine still stops
        await asyncio.sleep(0.05)
        assert not listening.done()  # not a reason to kill anything
        listening.cancel()  # the engine's stop finished
        assert await asyncio.wait_for(control.next_word(), 1) == STOP
    finally:
        supervisor.close()
        writer.close()
        await writer.wait_closed()


async def test_kill_and_a_closed_line_end_the_listener_and_earlier_words_stay_kept() -> None:
    control, supervisor, writer = await _line()
    try:
        supervisor.sendall(STOP + b"\n" + KILL + b"\n")
        assert await asyncio.wait_for(_supervisor_gone(control), 1) == "second signal"
        assert await control.next_word() == STOP
        supervisor.close()
        assert await asyncio.wait_for(_supervisor_gone(control), 1) == "the supervisor is gone"
    finally:
        supervisor.close()
        writer.close()
        await writer.wait_closed()
