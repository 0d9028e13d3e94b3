"""WorkerClient: one interface to a model instance, in this process or in a spawned worker process."""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Protocol

import numpy as np

from geserve._generated import model_config_pb2 as mc
from geserve.errors import GeserveError
from geserve.types import InstanceStatus
from geserve.workers.messages import Executed, InstanceSpec, RequestInfo
from geserve.workers.runner import InstanceRunner

logger = logging.getLogger(__name__)


# Where a streamed request's responses go, on the event loop: (outputs, error, final).
ResponseSink = Callable[[dict[str, np.ndarray] | None, GeserveError | None, bool], None]


class InstanceState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"  # died; a new process is on its way
    FAILED = "failed"  # gave up (crash loop, or a restart that cannot load)
    STOPPED = "stopped"


class WorkerClient(Protocol):
    """A model instance as the scheduler sees it."""

    spec: InstanceSpec
    # How many batches the instance takes at once (one running, the others queued behind it).
    capacity: int
    # Called on the event loop when the instance (re)becomes ready after a restart.
    on_ready: Callable[[WorkerClient], None] | None

    @property
    def alive(self) -> bool:
        """Ready to take a batch now."""
        ...

    @property
    def recoverable(self) -> bool:
        """Ready, or expected back (restarting)."""
        ...

    async def start(self) -> mc.ModelConfig:
        """Load the instance; returns the config it serves, raises ModelLoadError."""
        ...

    async def execute(
        self,
        inputs: Mapping[str, Sequence[np.ndarray]],
        output_names: tuple[str, ...],
        requests: Sequence[RequestInfo] = (),
        sinks: Sequence[ResponseSink | None] = (),
    ) -> Executed:
        """Run one batch; each input is given as the row blocks of the requests, in order. `requests`
        describe them for backends that answer request by request; a request with a sink streams its
        responses there (decoupled models), also after the batch has returned."""
        ...

    def cancel_stream(self, sink: ResponseSink) -> None:
        """The client of a streamed request went away: tell the model, drop what it still sends."""
        ...

    # What the model said at the last status read (its is_ready()); True until then.
    model_ready: bool

    async def read_status(self) -> InstanceStatus | None:
        """Device usage, readiness and custom metrics, read between batches; None when unavailable."""
        ...

    async def stop(self, timeout_s: float) -> None: ...

    def kill(self) -> None:
        """Stop at once (a second shutdown signal): no drain, no waiting."""
        ...


def concatenate(parts: Sequence[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


class InProcessWorker:
    """Runs the backend in this process on a dedicated thread: for tests, debugging and benchmarks."""

    def __init__(self, spec: InstanceSpec) -> None:
        self.spec = spec
        self.capacity = 1
        self.on_ready: Callable[[WorkerClient], None] | None = None
        self._runner = InstanceRunner(spec)
        self.model_ready = True
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"geserve-{spec.instance_name}")
        self._state = InstanceState.STARTING

    @property
    def alive(self) -> bool:
        return self._state is InstanceState.READY

    @property
    def recoverable(self) -> bool:
        return self.alive

    async def start(self) -> mc.ModelConfig:
        config = await asyncio.get_running_loop().run_in_executor(self._thread, self._runner.load)
        self._state = InstanceState.READY
        return config

    async def execute(
        self,
        inputs: Mapping[str, Sequence[np.ndarray]],
        output_names: tuple[str, ...],
        requests: Sequence[RequestInfo] = (),
        sinks: Sequence[ResponseSink | None] = (),
    ) -> Executed:
        loop = asyncio.get_running_loop()
        arrays = {name: concatenate(parts) for name, parts in inputs.items()}
        infos = tuple(replace(info, stream_id=index) for index, info in enumerate(requests))
        targets = list(sinks)

        def emit(index: int, outputs: Mapping[str, np.ndarray] | None, error: GeserveError | None, final: bool) -> None:
            sink = targets[index] if index < len(targets) else None
            if sink is not None:
                loop.call_soon_threadsafe(sink, dict(outputs) if outputs else None, error, final)

        return await loop.run_in_executor(
            self._thread, functools.partial(self._runner.execute, arrays, output_names, None, infos, emit)
        )

    def cancel_stream(self, sink: ResponseSink) -> None:
        return None

    async def read_status(self) -> InstanceStatus | None:
        if not self.alive:
            return None
        status = await asyncio.get_running_loop().run_in_executor(self._thread, self._runner.status)
        self.model_ready = status.ready
        return status

    async def stop(self, timeout_s: float) -> None:
        self._state = InstanceState.STOPPED
        await asyncio.get_running_loop().run_in_executor(self._thread, self._runner.unload)
        self._thread.shutdown(wait=False)

    def kill(self) -> None:
        self._state = InstanceState.STOPPED
