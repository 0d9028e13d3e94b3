"""InferenceService: the in-process InferenceAPI, owner of the models and every piece of server state."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any

import geserve
from geserve import log_records
from geserve._generated import model_config_pb2 as mc
from geserve.batching.request import ScheduledRequest
from geserve.batching.scheduler import Scheduler
from geserve.batching.sequence import SequenceScheduler
from geserve.core import calls, limits, response_cache, validation
from geserve.core.api import HISTOGRAM_FAMILY, EngineAPI
from geserve.core.instance_monitor import InstanceMonitor
from geserve.core.latency import DEFAULT_BUCKETS_MS, LatencyTracker
from geserve.core.log_control import LogControl
from geserve.core.models import Model, ModelVersion, find_version
from geserve.core.pool_factory import PoolFactory
from geserve.core.raw import decoded_raw
from geserve.core.repository import ModelRepository
from geserve.core.shared_memory import CudaSharedMemory, RegionLimits, SharedMemoryManager
from geserve.core.stats import statistics_json
from geserve.core.trace import TraceController, traced_steps
from geserve.errors import (
    CancelledError,
    DecoupledModelError,
    GeserveError,
    InternalError,
    NotFoundError,
    UnavailableError,
)
from geserve.offload import DECODE_BYTES, off_loop
from geserve.residency import SharedTensor
from geserve.settings import MetricsSettings, RepositorySettings, ServerSettings
from geserve.submissions import Answer, Submission
from geserve.types import (
    CacheSnapshot,
    CallChain,
    CustomMetric,
    DeviceUsage,
    InferInput,
    InferRequest,
    ModelMetadata,
    RequestedOutput,
    ServerMetadata,
    TraceContext,
    TraceRecord,
    VersionSnapshot,
    response_parameters,
)

logger = logging.getLogger(__name__)

# Protocol extensions that work end to end; clients (perf_analyzer) key behaviour off this list.
# How long a scrape waits for the instances to say what their custom metrics hold now.
SCRAPE_READ_S = 1.0
EXTENSIONS = (
    "classification",
    "model_repository",
    "model_repository(unload_dependents)",
    "schedule_policy",
    "sequence",
    "model_configuration",
    "system_shared_memory",
    "binary_tensor_data",
    "parameters",
    "statistics",
    "trace",
    "logging",
    "generate",
)


class InferenceService:
    """Owns the models of the repositories and answers health, metadata, inference and the protocol
    extensions (repository control, shared memory, statistics, trace, logging): the InferenceAPI in process.
    `metrics` says which latency summaries and histograms the versions keep (none without it)."""

    def __init__(
        self,
        server: ServerSettings,
        repository: RepositorySettings,
        pools: PoolFactory,
        *,
        metrics: MetricsSettings | None = None,
    ) -> None:
        self._server = server
        self._repository = ModelRepository(repository, pools, float(server.exit_timeout_secs))
        if metrics is not None and (metrics.summary_latencies or metrics.histogram_latencies):
            self._repository.listeners.append(lambda version: _track_latency(version, metrics))
        self._models = self._repository.models
        self._cache = response_cache.ResponseCache(server.response_cache_bytes) if server.response_cache_bytes else None
        self._repository.listeners.append(self._attach_cache)
        self._shared_memory = SharedMemoryManager(
            server.allow_client_shm,
            reserved_prefixes=(pools.segment_prefix,),
            limits=RegionLimits(server.max_client_shm_regions, server.max_client_shm_bytes),
        )
        self._cuda_shared_memory = CudaSharedMemory()
        self._traces = TraceController(server.trace)
        self._traces.open()  # mode opentelemetry's exporting starts here, where the engine runs
        self._log_control = LogControl(server.logging)
        self._monitor = InstanceMonitor(self.loaded_versions)
        self._accepting = False
        self._draining = False

    # -- lifecycle -------------------------------------------------------------------------

    async def load_models(self) -> dict[str, str]:
        """Load the models the control mode loads at start; returns the failures as name -> reason."""
        failures = await self._repository.load_startup()
        self._repository.start_polling()
        self._accepting = True
        return failures

    def start_monitoring(self, interval_s: float) -> None:
        """Read the instances' status every interval: device usage, readiness and custom metrics."""
        self._monitor.start(interval_s)

    # -- the model repository extension ----------------------------------------------------

    async def repository_index(self, ready_only: bool = False) -> list[dict[str, str]]:
        return await self._repository.index(ready_only)

    async def load_model(self, name: str, parameters: Mapping[str, Any] | None = None) -> None:
        await self._repository.load(name, parameters)

    async def unload_model(self, name: str, unload_dependents: bool = False, wait: bool = True) -> None:
        """Stop serving `name`; with `wait` False, return once it stops admitting requests (a python model's
        unload_model, which Triton does not make wait for the model's requests)."""
        await self._repository.unload(name, unload_dependents, wait=wait)

    # -- the shared-memory extensions -----------------------------------------------------

    async def shared_memory_status(self, name: str = "") -> list[dict[str, Any]]:
        return self._shared_memory.status(name)

    async def register_shared_memory(self, name: str, key: Any, offset: Any, byte_size: Any) -> None:
        self._shared_memory.register(name, key, offset, byte_size)

    async def unregister_shared_memory(self, name: str = "") -> None:
        """One region, or all of them when `name` is empty."""
        self._shared_memory.unregister(name)

    async def cuda_shared_memory_status(self, name: str = "") -> list[dict[str, Any]]:
        return self._cuda_shared_memory.status(name)

    async def register_cuda_shared_memory(self) -> None:
        self._cuda_shared_memory.register()

    async def unregister_cuda_shared_memory(self, name: str = "") -> None:
        self._cuda_shared_memory.unregister(name)

    # -- the trace and logging extensions -------------------------------------------------

    async def trace_settings(self, model: str | None = None) -> dict[str, list[str] | str]:
        """The global trace settings, or a model's (Triton's errors for an unknown model)."""
        if model is not None:
            self.model_version(model)
        return self._traces.settings(model)

    async def update_trace_settings(self, model: str | None, changes: Mapping[str, Any]) -> dict[str, Any]:
        """Apply changes (a None value clears a model's own setting); returns the settings now in force."""
        if model is not None:
            self.model_version(model)
        return self._traces.update(model, changes)

    async def record_trace(self, trace: TraceRecord) -> None:
        """A response's trace, completed by the front-end that sent it: written where the settings say."""
        self._traces.record(trace)

    async def log_settings(self) -> dict[str, Any]:
        return self._log_control.as_json()

    async def update_log_settings(self, changes: dict[str, Any]) -> dict[str, Any]:
        """Apply changes (nothing changes when any is bad); returns the settings now in force."""
        self._log_control.update(changes)
        return self._log_control.as_json()

    def start_draining(self) -> None:
        """Report not ready from now on, while still serving (the first step of shutdown)."""
        self._draining = True

    def stop_accepting(self) -> None:
        """Refuse new inference requests from now on; those already admitted finish."""
        self._draining = True
        self._accepting = False

    def kill(self) -> None:
        """Forced exit: kill every worker and release its shared memory, without waiting."""
        for model in self._models.values():
            for version in model.versions.values():
                version.kill()

    async def shutdown(self, timeout_s: float | None = None) -> None:
        """Stop answering as ready, stop every worker (within `timeout_s`, by default --exit-timeout-secs) and
        release the clients' shared memory."""
        self._accepting = False
        await self._monitor.stop()
        await self._repository.shutdown(timeout_s)
        self._shared_memory.close()
        await asyncio.to_thread(self._traces.close)  # the last traces, and the end of the trace file

    # -- health and metadata ---------------------------------------------------------------

    async def live(self) -> bool:
        return True

    async def ready(self) -> bool:
        if not self._accepting or self._draining:
            return False
        if not self._server.strict_readiness:
            return True
        return all(model.unloaded or (not model.reason and model.ready_versions()) for model in self._models.values())

    async def server_metadata(self) -> ServerMetadata:
        return ServerMetadata(self._server.server_id, geserve.__version__, EXTENSIONS)

    def model_version(self, name: str, version: str = "") -> ModelVersion:
        """The version a request addresses; Triton's errors for unknown models and versions."""
        return find_version(self._models, name, version)

    async def model_ready(self, name: str, version: str = "") -> bool:
        """Whether the model (version) can serve; unknown model names are an error, as in Triton."""
        try:
            self.model_version(name, version)
        except (NotFoundError, UnavailableError):
            return False
        return True

    async def model_metadata(self, name: str, version: str = "") -> ModelMetadata:
        found = self.model_version(name, version)
        if version:
            versions: tuple[str, ...] = (found.version_str,)
        else:
            versions = tuple(v.version_str for v in self._models[name].ready_versions())
        return found.metadata(versions)

    async def model_config(self, name: str, version: str = "") -> mc.ModelConfig:
        """A copy of the version's config: what a caller does with it changes nothing served."""
        config = mc.ModelConfig()
        config.CopyFrom(self.model_version(name, version).config)
        return config

    def loaded_versions(self) -> list[ModelVersion]:
        """Every loaded version of every model, by name then version."""
        return [
            model.versions[number] for _, model in sorted(self._models.items()) for number in sorted(model.versions)
        ]

    async def version_statistics(self) -> list[VersionSnapshot]:
        """Every loaded version's counters, by name then version (what the metrics publish)."""
        return [
            version.stats.snapshot(
                version.name,
                version.version,
                tuple(version.config.metric_tags.items()),
                cached=version.response_cache is not None,
                npu_fallback=version.npu_fallback,
            )
            for version in self.loaded_versions()
        ]

    async def cache_statistics(self) -> CacheSnapshot | None:
        """The response cache's figures, or None without one (--cache-config)."""
        return self._cache.snapshot() if self._cache is not None else None

    def _attach_cache(self, version: ModelVersion) -> None:
        """A version that just loaded uses the server's cache when its config enables it. As in Triton, a config
        that enables it on a server without one serves uncached: said once, at load."""
        if self._cache is not None:
            self._cache.note_load()
        if not response_cache.enabled(version.config):
            return
        if self._cache is None:
            logger.warning(
                "model '%s' version %s sets %s but the server has no response cache (--cache-config local,size=N): "
                "its responses are not cached",
                version.name,
                version.version_str,
                response_cache.FIELD,
            )
            return
        self._cache.attach(version)

    async def device_usage(self) -> dict[int, DeviceUsage]:
        """The accelerators' memory and load at the last status read, by device."""
        return self._monitor.device_usage

    async def custom_metrics(self) -> list[CustomMetric]:
        """The python models' own metrics as their instances hold them now, summed over the instances: read at
        each scrape, as Triton's are, not a polling interval late (the last reading when the instances do not all
        answer within SCRAPE_READ_S)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._monitor.refresh()), SCRAPE_READ_S)
        return self._monitor.custom_metrics

    async def statistics(self, name: str = "", version: str = "") -> list[dict[str, Any]]:
        """The statistics extension's `model_stats`: all models, one model's versions, or one version."""
        if not name:
            versions = self.loaded_versions()
        elif version:
            versions = [self.model_version(name, version)]
        else:
            self.model_version(name)  # Triton's errors for unknown or unavailable models
            versions = [self._models[name].versions[number] for number in sorted(self._models[name].versions)]
        return [statistics_json(v.name, v.version_str, v.stats) for v in versions]

    # -- inference -------------------------------------------------------------------------

    @property
    def models(self) -> Mapping[str, Model]:
        """The served models, as requests are checked against them."""
        return self._models

    @property
    def shared_memory(self) -> SharedMemoryManager:
        """The client regions registered (what requests' tensors may name)."""
        return self._shared_memory

    def watch(self, models: Callable[[], None], regions: Callable[[], None]) -> None:
        """Call `models` whenever the served models change and `regions` whenever the client regions do."""
        self._repository.on_change.append(models)
        self._shared_memory.on_change.append(regions)

    def refused(self, model_name: str, version: int) -> None:
        """A request a front door refused after finding its version: a failure of that version's requests."""
        model = self._models.get(model_name)
        served = model.versions.get(version) if model is not None else None
        if served is not None:
            served.stats.record_failure("OTHER", 0)

    def submit(self, submission: Submission, done: Callable[[Answer | GeserveError], None]) -> Callable[[], None]:
        """Schedule one request checked where it was decoded; its answer, or its error (carrying Triton's request-id
        prefix), goes to `done`. Returns what cancels it (its client went away). A request to a batching model goes
        straight into its scheduler's queue, answered from its batch: no task and no future of its own. Ensembles,
        cached and traced requests run as a task, as `infer_submission`."""
        request_id = submission.request_id
        try:
            model, scheduled = self._admit_submission(submission)
        except GeserveError as error:
            done(error)
            return _nothing
        scheduler = model.scheduler
        direct = not model.decoupled and model.response_cache is None and not self._traces.active
        if direct and isinstance(scheduler, Scheduler | SequenceScheduler):
            version = model.version_str

            def finished(outcome: dict[str, SharedTensor] | GeserveError) -> None:
                if isinstance(outcome, GeserveError):
                    done(outcome.with_request_id(request_id))
                else:
                    done(Answer(outcome, version, response_parameters(outcome)))

            try:
                pending = scheduler.submit(scheduled, finished)
            except GeserveError as error:  # a full queue
                done(error.with_request_id(request_id))
                return _nothing
            return lambda: scheduler.cancel(pending)
        answering = self._answer(model, scheduled, time.monotonic_ns(), submission.trace_context)
        task = asyncio.get_running_loop().create_task(answering)
        task.add_done_callback(lambda _: done(_outcome(task, model, request_id)))
        return _canceller(task)

    async def infer_submission(self, submission: Submission) -> Answer:
        """Schedule and run one request checked where it was decoded; errors carry Triton's request-id prefix. A
        decoupled model answers only streams: the request fails with DecoupledModelError."""
        started_ns = time.monotonic_ns()
        model, scheduled = self._admit_submission(submission)
        return await self._answer(model, scheduled, started_ns, submission.trace_context)

    async def stream_submission(self, submission: Submission) -> AsyncGenerator[Answer]:
        """Every response to one request, as the model sends them (one, final, for a model that is not
        decoupled). Errors before the model runs are raised; the model's own come as answers."""
        started_ns = time.monotonic_ns()
        model, scheduled = self._admit_submission(submission)
        if not model.decoupled:
            yield await self._answer(model, scheduled, started_ns, submission.trace_context)
            return
        request_id = scheduled.request_id
        try:
            async for outputs, error, final in model.scheduler.stream(scheduled):
                failed = error.with_request_id(request_id) if error else None
                parameters = response_parameters(outputs)
                yield Answer(outputs, model.version_str, parameters, None, final, failed)
        except GeserveError as error:
            raise error.with_request_id(request_id) from None

    async def _answer(
        self, model: ModelVersion, scheduled: ScheduledRequest, started_ns: int, context: TraceContext | None = None
    ) -> Answer:
        """One admitted request's answer, traced when tracing is on (continuing the client's trace `context`)."""
        request_id = scheduled.request_id
        traces = self._traces
        trace = traces.start(model.name, model.version_str, request_id, context) if traces.active else None
        try:
            if model.decoupled:
                raise DecoupledModelError(f"model '{model.name}' is decoupled: it answers streams only")
            if trace is None:
                answered = await response_cache.execute(model, scheduled, started_ns)
            else:  # an ensemble notes the steps it runs for a traced request: they are the trace's children
                noted = traced_steps.set(trace.steps)
                try:
                    answered = await response_cache.execute(model, scheduled, started_ns)
                finally:
                    traced_steps.reset(noted)
        except GeserveError as error:
            if trace is not None:  # a failed request's trace is written too, as Triton's (its core moments only)
                trace.mark("REQUEST_START", started_ns)
                trace.mark("REQUEST_END", time.monotonic_ns())
                self._traces.record(trace.finished())
            raise error.with_request_id(request_id) from None
        record = None
        if trace is not None:
            trace.mark("REQUEST_START", started_ns)
            if answered.timestamps is not None:  # an ensemble's are its steps'
                trace.add(answered.timestamps.marks())
            trace.mark("REQUEST_END", time.monotonic_ns())
            # The front-end adds its receive and send moments and hands the trace back (record_trace).
            record = trace.finished()
        outputs = answered.outputs
        return Answer(outputs, model.version_str, response_parameters(outputs), record)

    def _admit_submission(self, submission: Submission) -> tuple[ModelVersion, ScheduledRequest]:
        """The version a submission addresses (found again: its readiness is the engine's to tell) and the request as
        its scheduler takes it; checked again when another load of the version serves now than the one it was
        checked against."""
        if not self._accepting:
            raise UnavailableError("the server is shutting down").with_request_id(submission.request_id)
        try:
            model = self.model_version(submission.model_name, submission.requested_version)
            if model.version == submission.version and model.load == submission.load:
                inputs = {name: validation.reshaped(tensor, model.inputs[name]) for name, tensor in submission.inputs}
                output_names = submission.output_names
            else:
                inputs, output_names = self._recheck(model, submission)
        except GeserveError as error:
            raise error.with_request_id(submission.request_id) from None
        return model, ScheduledRequest(inputs, output_names, submission.parameters, submission.request_id)

    def _recheck(self, model: ModelVersion, submission: Submission) -> tuple[dict[str, SharedTensor], tuple[str, ...]]:
        """A submission checked against another load of the version (reloaded meanwhile), checked against this one."""
        request = InferRequest(
            model.name,
            model.version_str,
            tuple(InferInput(name, tensor.datatype, tensor.shape, tensor) for name, tensor in submission.inputs),
            tuple(RequestedOutput(name) for name in submission.output_names),
            submission.request_id,
            submission.parameters,
        )
        try:
            inputs = validation.validate_inputs(request, model, None, self._server.max_bytes_elements)
            return inputs, validation.requested_output_names(request, model)
        except GeserveError:
            model.stats.record_failure("OTHER", 0)
            raise

    async def call_model(self, request: InferRequest, chain: CallChain = ()) -> dict[str, SharedTensor]:
        """A python model's BLS request (`exec`), part of `chain`: validated and scheduled as a client's request,
        also while the server drains at shutdown (the request that made it was admitted); its outputs as arrays.
        A request that could only wait for itself (calls.check_cycle) is refused."""
        model, scheduled = await self._admit(request, internal=True, chain=chain)
        if model.decoupled:
            raise DecoupledModelError(
                f"model '{model.name}' is decoupled: call it with exec(decoupled=True) or async_exec(decoupled=True)"
            )
        return (await response_cache.execute(model, scheduled)).outputs

    async def stream_model(
        self, request: InferRequest, chain: CallChain = ()
    ) -> AsyncIterator[tuple[dict[str, SharedTensor] | None, GeserveError | None, bool]]:
        """A BLS request with `decoupled=True`, part of `chain`: every response the model sends (one, for a model
        that is not decoupled)."""
        model, scheduled = await self._admit(request, internal=True, chain=chain)
        if not model.decoupled:
            yield (await response_cache.execute(model, scheduled)).outputs, None, True
            return
        async for item in model.scheduler.stream(scheduled):
            yield item

    async def _admit(
        self, request: InferRequest, internal: bool = False, chain: CallChain = ()
    ) -> tuple[ModelVersion, ScheduledRequest]:
        """The version a request addresses and the request as its scheduler takes it, validated; a BLS request
        carries its `chain`."""
        # Before anything quotes the id: an id over its bound is not repeated back in the error.
        limits.check_request(request.id, request.parameters)
        if not self._accepting and not internal:
            raise UnavailableError("the server is shutting down").with_request_id(request.id)
        try:
            validation.check_parameters(request.parameters)
            model = self.model_version(request.model_name, request.model_version)
            calls.check_cycle(model.name, model.version, model.instance_count, chain)
            request = decoded_raw(request, model.name, tuple(model.inputs.values()))
        except GeserveError as error:
            raise error.with_request_id(request.id) from None
        try:
            inputs = await off_loop(
                validation.decode_cost(request),
                DECODE_BYTES,
                validation.validate_inputs,
                request,
                model,
                self._shared_memory,
                self._server.max_bytes_elements,
            )
            output_names = validation.requested_output_names(request, model)
        except GeserveError as error:
            model.stats.record_failure("OTHER", 0)
            raise error.with_request_id(request.id) from None
        return model, ScheduledRequest(inputs, output_names, request.parameters, request.id, chain=chain)


def _nothing() -> None:
    """What cancels a request answered already."""


def _canceller(task: asyncio.Task[Answer]) -> Callable[[], None]:
    def cancel() -> None:
        task.cancel()

    return cancel


def _outcome(task: asyncio.Task[Answer], model: ModelVersion, request_id: str) -> Answer | GeserveError:
    """A request's task, once done, as its answer or its error."""
    if task.cancelled():
        return CancelledError("the request was cancelled").with_request_id(request_id)
    error = task.exception()
    if error is None:
        return task.result()
    if isinstance(error, GeserveError):
        return error
    fields = log_records.request_fields(model.name, model.version_str, request_id)
    logger.error("a request failed in the engine", exc_info=error, extra=fields)
    return InternalError(f"{type(error).__name__}: {error}").with_request_id(request_id)


def _track_latency(version: ModelVersion, metrics: MetricsSettings) -> None:
    """Latency summaries and the first-response histogram of a version that just loaded, as the metrics ask;
    a version's config may set its own histogram buckets (model_metrics.metric_control)."""
    quantiles = tuple(q for q, _ in metrics.summary_quantiles) if metrics.summary_latencies else None
    bounds = _histogram_bounds(version.config) if metrics.histogram_latencies else None
    version.stats.latency = LatencyTracker(quantiles, bounds)


def _histogram_bounds(config: mc.ModelConfig) -> tuple[float, ...]:
    for control in config.model_metrics.metric_control:
        if control.metric_identifier.family == HISTOGRAM_FAMILY and control.histogram_options.buckets:
            return tuple(control.histogram_options.buckets)
    return DEFAULT_BUCKETS_MS


if TYPE_CHECKING:
    # mypy proves here that the engine answers every call of its API.
    _ENGINE: type[EngineAPI] = InferenceService
