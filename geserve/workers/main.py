"""Worker process entry point: one model instance, answering Execute messages over a pipe."""

from __future__ import annotations

import logging
import os
import signal
from multiprocessing.connection import Connection

from geserve.errors import ModelLoadError
from geserve.workers.messages import Execute, InstanceSpec, Loaded, LoadFailed, Shutdown
from geserve.workers.runner import InstanceRunner

logger = logging.getLogger(__name__)


def run_worker(connection: Connection, spec: InstanceSpec) -> None:
    """Serve one instance until Shutdown or until the front-end's end of the pipe closes."""
    # Ctrl-C reaches the whole process group; the front-end decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=spec.log_level,
        format=(
            f"%(asctime)s %(levelname)s [worker model={spec.model_name} version={spec.model_version} "
            f"instance={spec.instance_name} device={spec.device_id} pid={os.getpid()}] %(name)s: %(message)s"
        ),
    )
    runner = InstanceRunner(spec)
    try:
        config = runner.load()
    except ModelLoadError as error:
        connection.send(LoadFailed(error.message))
        return
    connection.send(Loaded(config.SerializeToString()))
    try:
        while True:
            try:
                message = connection.recv()
            except EOFError:
                break
            if isinstance(message, Shutdown):
                break
            if isinstance(message, Execute):
                connection.send(runner.execute(message))
            else:
                logger.error("ignoring unknown message %r", type(message).__name__)
    finally:
        runner.unload()
        connection.close()
