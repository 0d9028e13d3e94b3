"""WorkerClient: one interface to a model instance; ThreadWorker runs it on a thread of this process."""

from __future__ import annotations

import asyncio
import enum
import functools
import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import numpy as np

from geserve._generated import model_config_pb2 as mc
from geserve.backends import registry
from geserve.errors import GeserveError, ModelLoadError, UnavailableError
from geserve.residency import SharedTensor, gather, torn_rows, unreadable_rows, zeroed
from geserve.types import InstanceStatus, response_parameters, with_parameters
from geserve.workers.batch import Batch
from geserve.workers.messages import BatchResult, InstanceSpec, RunResult
from geserve.workers.runner import InstanceRunner

logger = logging.getLogger(__name__)


class InstanceState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"  # died; a new process is on its way
    FAILED = "failed"  # gave up (crash loop, or a restart that cannot load)
    STOPPED = "stopped"


class WorkerClient(Protocol):
    """One model instance, as its pool sees it: in this process (ThreadWorker) or in a worker process
    (ProcessWorker)."""

    spec: InstanceSpec
    # How many batches the instance takes at once (one running, the others queued behind it).
    capacity: int
    # Called on the event loop when the instance (re)becomes ready after a restart.
    on_ready: Callable[[WorkerClient], None] | None
    # What the model said at the last status read (its is_ready()); True until then.
    model_ready: bool

    @property
    def incarnation(self) -> int:
        """Counts the processes that have served the instance: a sequence's state lives in one of them."""
        ...

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

    async def execute(self, batch: Batch) -> BatchResult:
        """Run one batch: every request's outputs (or its own error), in order. Raises GeserveError when the
        instance cannot run it (not running, died meanwhile)."""
        ...

    async def read_status(self) -> InstanceStatus | None:
        """Device usage, readiness and custom metrics, read between batches; None when unavailable."""
        ...

    async def stop(self, timeout_s: float) -> None: ...

    def kill(self) -> None:
        """Stop at once (a second shutdown signal): no drain, no waiting."""
        ...


def observes_cancellation(spec: InstanceSpec) -> bool:
    """Whether the instance's backend sees each request (a python model's `is_cancelled`): only its unary requests
    are worth telling about a client that went away."""
    try:
        return registry.by_name(spec.backend).per_request
    except ModelLoadError:
        return False  # it will not load either


def local_tensors(outputs: Mapping[str, np.ndarray]) -> dict[str, SharedTensor]:
    """A backend's outputs in this process as the scheduler takes them, with the response parameters they carry."""
    tensors = {name: SharedTensor.local(np.asarray(array)) for name, array in outputs.items()}
    return with_parameters(tensors, response_parameters(outputs))


class ThreadWorker:
    """Runs the backend on a thread of this process: for tests, debugging and benchmarks."""

    def __init__(self, spec: InstanceSpec) -> None:
        self.spec = spec
        self.capacity = 1
        self.on_ready: Callable[[WorkerClient], None] | None = None
        self._runner = InstanceRunner(spec)
        self.model_ready = True
        self.incarnation = 0
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"geserve-{spec.instance_name}")
        self._state = InstanceState.STARTING
        self._stream_ids = itertools.count()  # stream and cancel ids
        self._per_request = observes_cancellation(spec)

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

    async def execute(self, batch: Batch) -> BatchResult:
        if not self.alive:
            raise UnavailableError(f"instance '{self.spec.instance_name}' is {self._state.value}")
        loop = asyncio.get_running_loop()
        refused: dict[int, GeserveError] = {}
        infos = list(batch.requests)
        streams = batch.streams
        for index, stream in streams.items():
            stream_id = next(self._stream_ids)
            infos[index] = infos[index]._replace(stream_id=stream_id)
            stream.on_cancel(functools.partial(self._runner.cancelled.add, stream_id))
        cancellable = batch.cancellable if self._per_request else {}
        for index, request in cancellable.items():
            cancel_id = next(self._stream_ids)
            infos[index] = infos[index]._replace(cancel_id=cancel_id)
            request.on_cancel(functools.partial(self._runner.cancelled.add, cancel_id))

        def emit(index: int, outputs: Mapping[str, np.ndarray] | None, error: GeserveError | None, final: bool) -> None:
            stream = streams.get(index)
            if stream is not None:
                loop.call_soon_threadsafe(stream.put, local_tensors(outputs) if outputs else None, error, final)

        def run() -> RunResult:
            # On the instance's thread, not the event loop: joining the requests' rows copies the batch.
            arrays = _gathered(batch.inputs, len(infos), refused)
            ran = self._runner.execute(arrays, batch.output_names, tuple(infos), None, emit)
            # Inputs viewed in a client's region that shrank while they were read ran as zeros: answered with an error.
            refused.update(torn_rows(list(batch.inputs.values()), len(infos)))
            return ran

        try:
            result = await loop.run_in_executor(self._thread, run)
        finally:
            for request in cancellable.values():
                request.on_cancel(None)
        results = tuple(
            refused.get(index) or (outcome if isinstance(outcome, GeserveError) else local_tensors(outcome))
            for index, outcome in enumerate(result.results)
        )
        return BatchResult(results, result.infer_start_ns, result.infer_end_ns)

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


def _gathered(
    inputs: Mapping[str, Sequence[SharedTensor]], requests: int, refused: dict[int, GeserveError]
) -> dict[str, np.ndarray]:
    """Each input's parts joined into one array. A request whose client region shrank or was replaced since it was
    checked runs as zeros and is recorded in `refused`, to be answered with its error; the rest run."""
    try:
        return {name: gather(parts, parts[0].datatype) for name, parts in inputs.items()}
    except GeserveError:
        refused.update(unreadable_rows(list(inputs.values()), requests))
        if not refused or len(refused) == requests:
            raise
        return {name: gather(zeroed(parts, refused), parts[0].datatype) for name, parts in inputs.items()}
