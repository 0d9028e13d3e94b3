"""The start of a process the supervisor forks: signals and name set, then the engine's or a protocol loop."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import signal
import socket

from geserve.event_loop import loop_factory
from geserve.lifecycle import Role
from geserve.multiprocess.control import ControlLine, Launch
from geserve.multiprocess.engine import serve_engine
from geserve.multiprocess.protocol import serve_protocol

logger = logging.getLogger(__name__)

_PR_SET_NAME = 15


def run_child(launch: Launch, control_socket: socket.socket) -> int:
    """The exit status of the process (called in the child right after fork; never returns to the caller's
    code, which exits with the status)."""
    # The supervisor decides when this process stops: a signal to the process group (Ctrl-C, systemd) is its.
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _name_process("geserve-engine" if launch.role is Role.ENGINE else f"geserve-proto{launch.index}")
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            return runner.run(_serve(launch, control_socket))
    except BaseException:
        logger.exception("the %s process failed", launch.role.value)
        return 1
    finally:
        logging.shutdown()


async def _serve(launch: Launch, control_socket: socket.socket) -> int:
    control = await ControlLine.open(control_socket)
    if launch.role is Role.ENGINE:
        return await serve_engine(launch, control)
    return await serve_protocol(launch, control)


def _name_process(name: str) -> None:
    """The name `ps` and /proc/<pid>/comm show (the command line stays the supervisor's)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
