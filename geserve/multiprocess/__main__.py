"""Entry of the processes the supervisor starts: `python -m geserve.multiprocess engine|protocol <control fd>`."""

from __future__ import annotations

import asyncio
import logging
import socket
import sys

from geserve.cli import loop_factory
from geserve.core.log_control import LogSettings
from geserve.memory import keep_freed_memory
from geserve.multiprocess.control import ControlLine, Launch, receive_launch


def _configure_logging(launch: Launch) -> None:
    log_file = launch.settings.server.logging.log_file
    if log_file:
        logging.basicConfig(filename=log_file)
    else:
        logging.basicConfig()
    LogSettings(launch.settings.server.logging).apply()


async def _serve(launch: Launch, control_socket: socket.socket) -> int:
    control = await ControlLine.open(control_socket)
    if launch.role == "engine":
        from geserve.multiprocess.engine import serve_engine

        return await serve_engine(launch, control)
    from geserve.multiprocess.protocol import serve_protocol

    return await serve_protocol(launch, control)


def main(argv: list[str]) -> int:
    # SIGINT and SIGTERM are ignored from the start (inherited): the supervisor decides when this process stops.
    control_socket = socket.socket(fileno=int(argv[1]))
    launch = receive_launch(control_socket)
    _configure_logging(launch)
    keep_freed_memory()
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(_serve(launch, control_socket))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
