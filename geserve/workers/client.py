"""WorkerClient: one interface to a model instance, in this process or in a spawned worker process."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Protocol

import numpy as np

from geserve._generated import model_config_pb2 as mc
from geserve.errors import GeserveError, InternalError, ModelLoadError, UnavailableError
from geserve.workers import main as worker_main
from geserve.workers.messages import Execute, Executed, InstanceSpec, Loaded, LoadFailed, Shutdown
from geserve.workers.runner import InstanceRunner

logger = logging.getLogger(__name__)


class WorkerClient(Protocol):
    """A model instance as the scheduler sees it."""

    spec: InstanceSpec

    @property
    def alive(self) -> bool: ...

    async def start(self) -> mc.ModelConfig:
        """Load the instance; returns the config it serves, raises ModelLoadError."""
        ...

    async def execute(self, inputs: Mapping[str, np.ndarray], output_names: tuple[str, ...]) -> Executed: ...

    async def stop(self, timeout_s: float) -> None: ...


class InProcessWorker:
    """Runs the backend in this process on a dedicated thread: for tests and debugging."""

    def __init__(self, spec: InstanceSpec) -> None:
        self.spec = spec
        self._runner = InstanceRunner(spec)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"geserve-{spec.instance_name}")
        self._ids = itertools.count()
        self._alive = False

    @property
    def alive(self) -> bool:
        return self._alive

    async def start(self) -> mc.ModelConfig:
        config = await asyncio.get_running_loop().run_in_executor(self._thread, self._runner.load)
        self._alive = True
        return config

    async def execute(self, inputs: Mapping[str, np.ndarray], output_names: tuple[str, ...]) -> Executed:
        message = Execute(next(self._ids), dict(inputs), output_names)
        return await asyncio.get_running_loop().run_in_executor(self._thread, self._runner.execute, message)

    async def stop(self, timeout_s: float) -> None:
        self._alive = False
        await asyncio.get_running_loop().run_in_executor(self._thread, self._runner.unload)
        self._thread.shutdown(wait=False)


class ProcessWorker:
    """A spawned worker process; requests are matched to answers by id, and a worker that dies
    fails every request it had in flight at once."""

    def __init__(self, spec: InstanceSpec) -> None:
        self.spec = spec
        self._context = multiprocessing.get_context("spawn")
        self._process: multiprocessing.process.BaseProcess | None = None
        self._connection: Connection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Pipe writes block while the worker reads; one thread keeps them off the event loop, in order.
        self._sender = ThreadPoolExecutor(1, thread_name_prefix=f"geserve-send-{spec.instance_name}")
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future[Executed]] = {}
        self._started: asyncio.Future[Loaded | LoadFailed] | None = None
        self._alive = False
        self._stopping = False

    @property
    def alive(self) -> bool:
        return self._alive

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    async def start(self) -> mc.ModelConfig:
        loop = asyncio.get_running_loop()
        self._loop = loop
        parent, child = self._context.Pipe(duplex=True)
        process = self._context.Process(
            target=worker_main.run_worker,
            args=(child, self.spec),
            name=f"geserve-worker-{self.spec.instance_name}",
            daemon=True,
        )
        self._started = loop.create_future()
        # Starting a spawn process execs an interpreter; do it off the event loop.
        await loop.run_in_executor(self._sender, process.start)
        child.close()
        self._process, self._connection = process, parent
        threading.Thread(target=self._read_loop, name=f"geserve-recv-{self.spec.instance_name}", daemon=True).start()
        result = await self._started
        if isinstance(result, LoadFailed):
            await self.stop(timeout_s=5.0)
            raise ModelLoadError(result.message)
        self._alive = True
        return mc.ModelConfig.FromString(result.config)

    async def execute(self, inputs: Mapping[str, np.ndarray], output_names: tuple[str, ...]) -> Executed:
        connection, loop = self._connection, self._loop
        if not self._alive or connection is None or loop is None:
            raise UnavailableError(
                f"instance '{self.spec.instance_name}' of model '{self.spec.model_name}' is not running"
            )
        request_id = next(self._ids)
        future: asyncio.Future[Executed] = loop.create_future()
        self._pending[request_id] = future
        try:
            await loop.run_in_executor(self._sender, connection.send, Execute(request_id, dict(inputs), output_names))
        except (OSError, ValueError) as error:
            self._pending.pop(request_id, None)
            raise InternalError(
                f"failed to send request to instance '{self.spec.instance_name}' of model "
                f"'{self.spec.model_name}': {error}"
            ) from None
        try:
            return await future
        finally:
            self._pending.pop(request_id, None)

    async def stop(self, timeout_s: float) -> None:
        self._stopping = True
        self._alive = False
        loop = asyncio.get_running_loop()
        connection, process = self._connection, self._process
        if connection is not None:
            with contextlib.suppress(OSError, ValueError):  # the worker may be gone already
                await loop.run_in_executor(self._sender, connection.send, Shutdown())
        if process is not None:
            await loop.run_in_executor(None, process.join, timeout_s)
            if process.is_alive():
                logger.warning("instance %s did not stop in %.0fs; terminating it", self.spec.instance_name, timeout_s)
                process.terminate()
                await loop.run_in_executor(None, process.join, 5.0)
        if connection is not None:
            connection.close()
        self._sender.shutdown(wait=False)

    def _read_loop(self) -> None:
        """Receives answers on a thread and hands each to the event loop."""
        connection, process = self._connection, self._process
        assert connection is not None and process is not None
        while True:
            try:
                message = connection.recv()
            except (EOFError, OSError):
                break
            if not self._call_in_loop(self._on_message, message):
                return
        process.join(1.0)  # let the exit code settle so the error can report it
        self._call_in_loop(self._on_exit, process.exitcode)

    def _call_in_loop(self, callback: object, argument: object) -> bool:
        loop = self._loop
        if loop is None or loop.is_closed():
            return False
        try:
            loop.call_soon_threadsafe(callback, argument)  # type: ignore[arg-type]
        except RuntimeError:  # the loop closed meanwhile
            return False
        return True

    def _on_message(self, message: object) -> None:
        if isinstance(message, Executed):
            future = self._pending.pop(message.request_id, None)
            if future is not None and not future.done():
                future.set_result(message)
        elif isinstance(message, Loaded | LoadFailed):
            if self._started is not None and not self._started.done():
                self._started.set_result(message)
        else:
            logger.error("instance %s sent an unknown message %r", self.spec.instance_name, type(message).__name__)

    def _on_exit(self, exit_code: int | None) -> None:
        self._alive = False
        reason = (
            f"instance '{self.spec.instance_name}' of model '{self.spec.model_name}' version "
            f"{self.spec.model_version} exited unexpectedly (exit code {exit_code})"
        )
        if not self._stopping:
            logger.error("%s; failing its %d in-flight request(s)", reason, len(self._pending))
        if self._started is not None and not self._started.done():
            self._started.set_result(LoadFailed(reason))
        error: GeserveError = InternalError(reason)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        self._pending.clear()
