"""InstanceRunner: builds one backend instance from an InstanceSpec and executes batches on it."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from geserve._generated import model_config_pb2 as mc
from geserve.backends import registry
from geserve.backends.base import (
    BackendRequest,
    Capabilities,
    DeviceFaultError,
    OutputAllocator,
    PipelinedBackend,
    RequestBackend,
    RequestResult,
    ResponseEmitter,
)
from geserve.codecs import dtypes
from geserve.errors import GeserveError, InternalError, ModelLoadError
from geserve.repository.sequence import read_states
from geserve.types import CustomMetric, DeviceUsage, InstanceStatus, response_parameters, with_parameters
from geserve.workers.messages import InstanceSpec, RequestInfo, RunResult
from geserve.workers.states import SlotStates

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StagedBatch:
    """A batch in the runner's hands, from `stage` to `finish`: the arrays it runs on, what the backend staged of
    it, and its result if it already failed. (The batch a scheduler hands an instance is workers.batch.Batch.)"""

    inputs: Mapping[str, np.ndarray]
    output_names: tuple[str, ...]
    requests: Sequence[RequestInfo]
    started: int
    staged: object | None = None
    failure: RunResult | None = None


class InstanceRunner:
    """The backend side of a worker, shared by the in-process and the process worker."""

    def __init__(self, spec: InstanceSpec) -> None:
        self.spec = spec
        # The loaded backend, typed by what its registry entry says it can do; None when not loaded.
        self._loaded: Capabilities | None = None
        self.output_datatypes: dict[str, str] = {}
        # Set when the device failed under a batch: the worker must be replaced, not reused.
        self.fault = ""
        # The streams and running unary requests (by stream or cancel id) whose clients went away.
        self.cancelled: set[int] = set()
        self._states = SlotStates(())

    def load(self, on_created: Callable[[bool], None] | None = None) -> mc.ModelConfig:
        """Load the backend and return the config it serves; raises ModelLoadError. `on_created` hears, once
        the backend exists and before it loads, whether it runs the model's own code (which may call the
        server from `initialize`)."""
        spec = self.spec
        config = mc.ModelConfig.FromString(spec.config)
        created: Capabilities | None = None
        try:
            created = registry.by_name(spec.backend).create_typed()
            if created.model is not None:
                created.model.describe_instance(spec.instance_name, spec.kind)
            if on_created is not None:
                on_created(created.model is not None)
            created.backend.load(config, Path(spec.model_path), spec.device_id)
            created.backend.complete_config(config, spec.auto_complete)
            self._states = SlotStates(read_states(config, Path(spec.model_directory)))
        except Exception as error:
            if created is not None:
                with contextlib.suppress(Exception):
                    created.backend.unload()  # whatever `load` acquired before the failure
            if isinstance(error, GeserveError):
                raise ModelLoadError(error.message) from None
            logger.exception("instance %s failed to load", spec.instance_name)
            raise ModelLoadError(f"model '{spec.model_name}': {type(error).__name__}: {error}") from None
        self._loaded = created
        self.output_datatypes = {output.name: dtypes.from_config(output.data_type).wire for output in config.output}
        return config

    def execute(
        self,
        inputs: Mapping[str, np.ndarray],
        output_names: tuple[str, ...],
        requests: Sequence[RequestInfo],
        allocate: OutputAllocator | None = None,
        emit: ResponseEmitter | None = None,
    ) -> RunResult:
        """Run one batch and answer each of its `requests` (with views of their rows of the batch's outputs);
        any failure becomes their error, never an exception."""
        batch = self.stage(inputs, output_names, requests)
        self.launch(batch)
        return self.finish(batch, allocate, emit)[0]

    def stage(
        self, inputs: Mapping[str, np.ndarray], output_names: tuple[str, ...], requests: Sequence[RequestInfo]
    ) -> StagedBatch:
        """A batch made ready to launch: a pipelined backend copies its inputs to the device now, even while
        the batch before it runs."""
        batch = StagedBatch(inputs, output_names, requests, time.monotonic_ns())
        loaded = self._loaded
        if loaded is None:
            batch.failure = self._failed(
                InternalError(f"instance '{self.spec.instance_name}' is not loaded"), requests, batch.started
            )
            return batch
        states = self._states
        try:
            if states:
                batch.inputs = states.feed(inputs, requests)
                batch.output_names = output_names + tuple(n for n in states.output_names if n not in output_names)
            if loaded.pipelined is not None:
                batch.staged = loaded.pipelined.stage(batch.inputs)
        except Exception as error:  # states whose shapes do not stack, inputs the device refuses
            batch.failure = self._failed(error, requests, batch.started)
        return batch

    def stage_blocks(
        self, blocks: Mapping[str, Sequence[np.ndarray]], output_names: tuple[str, ...], requests: Sequence[RequestInfo]
    ) -> StagedBatch:
        """`stage` for a batch given as each input's row blocks (see `gathers`): the backend copies each block to the
        device where its rows go."""
        batch = StagedBatch({}, output_names, requests, time.monotonic_ns())
        backend = self._pipeline
        if backend is None:
            batch.failure = self._failed(InternalError("this backend stages joined batches"), requests, batch.started)
            return batch
        try:
            batch.staged = backend.stage_blocks(blocks)
        except Exception as error:  # inputs the device refuses
            batch.failure = self._failed(error, requests, batch.started)
        return batch

    @property
    def gathers(self) -> bool:
        """Whether the backend takes a batch as its requests' row blocks and copies them to the device itself: a
        pipelined backend, unless the model keeps implicit state, which is joined with the inputs first."""
        return self.pipelined and not self._states

    def failed_batch(
        self, error: Exception, output_names: tuple[str, ...], requests: Sequence[RequestInfo]
    ) -> StagedBatch:
        """A batch that cannot run (its inputs could not be read): `error` answers each of its requests."""
        batch = StagedBatch({}, output_names, requests, time.monotonic_ns())
        batch.failure = self._failed(error, requests, batch.started)
        return batch

    def launch(self, batch: StagedBatch) -> None:
        """Start a staged batch (the one launched before it has finished)."""
        backend = self._pipeline
        if batch.staged is None or batch.failure is not None or backend is None:
            return
        try:
            backend.launch(batch.staged)
        except Exception as error:
            batch.failure = self._failed(error, batch.requests, batch.started)

    @property
    def _pipeline(self) -> PipelinedBackend | None:
        return self._loaded.pipelined if self._loaded is not None else None

    @property
    def pipelined(self) -> bool:
        """Whether the backend runs a launched batch on its device while the host stages the next."""
        return self._pipeline is not None

    @property
    def runs_model_code(self) -> bool:
        """Whether the backend runs the model's own code, which may wait inside `execute` for BLS replies."""
        return self._loaded is not None and self._loaded.model is not None

    @property
    def stages_ahead(self) -> bool:
        """Whether the next batch may be staged before the running one finishes: not when the model keeps
        implicit state, which the next batch must read only after the running one has updated it."""
        return self.pipelined and not self._states

    def wait(self, batch: StagedBatch) -> None:
        """Block until a launched batch is done on the device (from a thread of its own); never raises."""
        backend = self._pipeline
        if batch.staged is not None and batch.failure is None and backend is not None:
            backend.wait(batch.staged)

    def discard(self, batch: StagedBatch) -> None:
        """Give back what a staged batch holds on the device when it will never run."""
        backend = self._pipeline
        if batch.staged is not None and batch.failure is None and backend is not None:
            with contextlib.suppress(Exception):
                backend.discard(batch.staged)

    def finish(
        self,
        batch: StagedBatch,
        allocate: OutputAllocator | None = None,
        emit: ResponseEmitter | None = None,
        *,
        split: bool = True,
    ) -> tuple[RunResult, dict[str, np.ndarray]]:
        """Run the batch (or wait for it, once launched) and answer each of its requests."""
        if batch.failure is not None:
            return batch.failure, {}
        loaded = self._loaded
        assert loaded is not None
        requests, output_names, started = batch.requests, batch.output_names, batch.started
        if loaded.per_request is not None:
            return self._execute_requests(loaded.per_request, batch.inputs, requests, emit, started), {}
        try:
            if batch.staged is not None and loaded.pipelined is not None:
                outputs = loaded.pipelined.finish(batch.staged, output_names, allocate)
            else:
                outputs = loaded.backend.execute(batch.inputs, output_names, allocate)
            missing = [name for name in output_names if name not in outputs]
            if missing:
                raise InternalError(f"model '{self.spec.model_name}' did not produce output(s) {missing}")
            arrays = {name: np.asarray(outputs[name]) for name in output_names}
            for name, array in arrays.items():
                if name in self.output_datatypes:  # a state output need not be declared
                    self._check_output(name, array)
            self._check_rows(arrays, requests)
            if self._states:
                self._states.keep_whole(arrays, requests)
            results = self._split(arrays, requests) if split else tuple({} for _ in requests)
        except Exception as error:
            return self._failed(error, requests, started), {}
        return RunResult(results, started, time.monotonic_ns()), arrays

    def _check_rows(self, outputs: dict[str, np.ndarray], requests: Sequence[RequestInfo]) -> None:
        """A batch of several requests needs outputs with a row per input row, to give each its own."""
        if len(requests) == 1:
            return
        rows = sum(info.rows for info in requests)
        for name, array in outputs.items():
            returned = array.shape[0] if array.ndim else 0
            if returned != rows:
                raise InternalError(
                    f"model '{self.spec.model_name}' returned output '{name}' with {returned} rows "
                    f"for a batch of {rows}"
                )

    def _split(self, outputs: dict[str, np.ndarray], requests: Sequence[RequestInfo]) -> tuple[RequestResult, ...]:
        """Each request's outputs: views of its rows of the batch's outputs, no copies."""
        if len(requests) == 1:
            return ({name: outputs[name] for name in requests[0].output_names},)
        results: list[RequestResult] = []
        row = 0
        for info in requests:
            results.append({name: outputs[name][row : row + info.rows] for name in info.output_names})
            row += info.rows
        return tuple(results)

    def _execute_requests(
        self,
        backend: RequestBackend,
        inputs: Mapping[str, np.ndarray],
        requests: Sequence[RequestInfo],
        emit: ResponseEmitter | None,
        started: int,
    ) -> RunResult:
        """The batch split back into its requests (views of the rows each sent), answered one by one."""
        split = []
        row = 0
        ragged_offsets: dict[str, int] = {}
        for info in requests:
            if len(requests) == 1:
                own = dict(inputs)
            else:
                own = {name: array[row : row + info.rows] for name, array in inputs.items()}
                for name, shape in info.ragged_shapes:
                    # A ragged input came flattened: this request's elements, back in its own shape.
                    start = ragged_offsets.get(name, 0)
                    end = start + math.prod(shape)
                    own[name] = inputs[name][start:end].reshape(shape)
                    ragged_offsets[name] = end
            row += info.rows
            cancelled = self._cancelled_flag(info.stream_id if info.stream_id >= 0 else info.cancel_id)
            split.append(BackendRequest(own, info.request_id, info.parameters, info.output_names, cancelled))
        try:
            answered = backend.execute_requests(split, emit or _drop)
        except Exception as error:
            return self._failed(error, requests, started)
        finally:
            for info in requests:
                if info.cancel_id >= 0:  # answered with the batch: nothing asks about it any more
                    self.cancelled.discard(info.cancel_id)
        finished = time.monotonic_ns()
        if answered is None:  # decoupled: the responses stream
            return RunResult(tuple({} for _ in requests), started, finished)
        results = tuple(self.checked(result) for result in answered)
        if self._states:
            self._states.keep_own(results, requests)
        if len(results) < len(requests):
            missing = InternalError(f"model '{self.spec.model_name}' returned no response for a request")
            results += (missing,) * (len(requests) - len(results))
        return RunResult(results[: len(requests)], started, finished)

    def _failed(self, error: Exception, requests: Sequence[RequestInfo], started: int) -> RunResult:
        """A failed batch: its error for every request (a device fault also retires the worker)."""
        if isinstance(error, DeviceFaultError):
            logger.error("instance %s: %s", self.spec.instance_name, error.message)
            self.fault = error.message
        if not isinstance(error, GeserveError):
            logger.exception("instance %s failed to execute", self.spec.instance_name, exc_info=error)
            error = InternalError(f"model '{self.spec.model_name}' failed to execute: {type(error).__name__}: {error}")
        return RunResult((error,) * len(requests), started, time.monotonic_ns())

    def checked(self, result: RequestResult | Mapping[str, np.ndarray]) -> RequestResult:
        """A request's outputs if they have the types the config declares, else its error."""
        if isinstance(result, GeserveError):
            return result
        try:
            for name, array in result.items():
                if name in self.output_datatypes:
                    self._check_output(name, np.asarray(array))
        except GeserveError as error:
            return error
        return with_parameters(dict(result), response_parameters(result))

    def _cancelled_flag(self, key: int) -> Callable[[], bool]:
        return lambda: key >= 0 and key in self.cancelled

    def _check_output(self, name: str, array: np.ndarray) -> None:
        declared = dtypes.from_wire(self.output_datatypes[name])
        matches = array.dtype.kind == "O" if declared.itemsize is None else array.dtype == declared.numpy
        if not matches:
            raise InternalError(
                f"model '{self.spec.model_name}' produced output '{name}' of type {array.dtype}, "
                f"but its config declares {declared.config_name}"
            )

    def status(self) -> InstanceStatus:
        """Device usage, the model's own readiness and metrics, from backends that have them."""
        model = self._loaded.model if self._loaded is not None else None
        ready = True
        metrics: tuple[CustomMetric, ...] = ()
        try:
            if model is not None:
                ready = bool(model.model_ready())
                metrics = tuple(model.custom_metrics())
        except Exception:
            logger.exception("instance %s could not report its status", self.spec.instance_name)
        return InstanceStatus(self.device_usage(), ready, metrics)

    def device_usage(self) -> DeviceUsage | None:
        """The device's memory and load, from backends that run on one; None otherwise."""
        reporter = self._loaded.device if self._loaded is not None else None
        if reporter is None:
            return None
        try:
            return reporter.device_usage()
        except Exception:
            logger.exception("instance %s could not read its device usage", self.spec.instance_name)
            return None

    def unload(self) -> None:
        if self._loaded is not None:
            try:
                self._loaded.backend.unload()
            except Exception:
                logger.exception("instance %s failed to unload", self.spec.instance_name)
            self._loaded = None


def _drop(index: int, outputs: Mapping[str, np.ndarray] | None, error: GeserveError | None, final: bool) -> None:
    """Where streamed responses go when nobody listens."""
