"""Ensembles: the step graph of `ensemble_scheduling`, checked as Triton checks it, and run step by step."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from geserve._generated import model_config_pb2 as mc
from geserve.batching.request import ScheduledRequest, ScheduledResponse
from geserve.core import calls, response_cache, validation
from geserve.core.models import Model, ModelVersion, StreamedOutputs, find_version
from geserve.core.stats import ModelStats
from geserve.core.trace import StepTrace, traced_steps
from geserve.errors import GeserveError, InternalError, ModelLoadError
from geserve.residency import SharedTensor
from geserve.types import (
    CallChain,
    InferInput,
    InferRequest,
    InstanceStatus,
    Parameters,
    RequestTiming,
    response_parameters,
    with_parameters,
)

logger = logging.getLogger(__name__)

ENSEMBLE_PLATFORM = "ensemble"


def is_ensemble(config: mc.ModelConfig) -> bool:
    return config.platform == ENSEMBLE_PLATFORM or config.HasField("ensemble_scheduling")


@dataclass(frozen=True, slots=True)
class Step:
    """One step: a composing model, which ensemble tensors feed its inputs and which of its outputs it writes."""

    index: int
    model_name: str
    model_version: int  # -1: the latest ready version
    inputs: dict[str, str]  # model input -> ensemble tensor
    outputs: dict[str, str]  # model output -> ensemble tensor


def steps_of(config: mc.ModelConfig) -> tuple[Step, ...]:
    return tuple(
        Step(index, step.model_name, int(step.model_version), dict(step.input_map), dict(step.output_map))
        for index, step in enumerate(config.ensemble_scheduling.step)
    )


def validate_scheduling(config: mc.ModelConfig) -> None:
    """The checks Triton makes of an ensemble's own config (ValidateEnsembleSchedulingConfig); ModelLoadError."""
    name = config.name
    if config.platform != ENSEMBLE_PLATFORM:
        raise ModelLoadError(
            f"ensemble scheduling cannot be set for model '{name}' whose platform is not {ENSEMBLE_PLATFORM}"
        )
    if not config.HasField("ensemble_scheduling"):
        raise ModelLoadError(f"ensemble scheduling must be set for ensemble {name} whose platform is ensemble")
    if config.instance_group:
        raise ModelLoadError(f"instance group should not be specified for ensemble '{name}'")
    if not config.ensemble_scheduling.step:
        raise ModelLoadError(f"must specify 'step' for ensemble '{name}'")
    writers: dict[str, int] = {}  # ensemble tensor -> the step that writes it
    readers: dict[str, list[int]] = {}
    for step in steps_of(config):
        where = f"step {step.index} of ensemble '{name}'"
        if not step.model_name:
            raise ModelLoadError(f"must specify 'model_name' in {where}")
        if not step.inputs:
            raise ModelLoadError(f"must specify 'input_map' in {where}")
        if not step.outputs:
            raise ModelLoadError(f"must specify 'output_map' in {where}")
        for tensor in step.outputs.values():
            if tensor in writers:
                raise ModelLoadError(
                    f"ensemble tensor '{tensor}' can appear in an output map only once for ensemble '{name}' "
                    f"step {step.index}"
                )
            writers[tensor] = step.index
        for tensor in step.inputs.values():
            readers.setdefault(tensor, []).append(step.index)
    steps = steps_of(config)
    ready = {tensor.name for tensor in config.input}
    for tensor in ready:
        if tensor not in readers and tensor not in writers:
            raise ModelLoadError(f"ensemble input '{tensor}' for ensemble {name}' is not used")
    # Data flow: a step runs once all its inputs are ready; whatever never becomes ready is a cycle or unfed.
    done: set[int] = set()
    progress = True
    while progress:
        progress = False
        for step in steps:
            if step.index not in done and all(tensor in ready for tensor in step.inputs.values()):
                done.add(step.index)
                ready.update(step.outputs.values())
                progress = True
    outputs = {tensor.name for tensor in config.output}
    for output in config.output:
        if output.name not in readers and output.name not in writers:
            raise ModelLoadError(f"ensemble output '{output.name}' for ensemble {name}' is not used")
        if output.name not in ready:
            raise ModelLoadError(f"output '{output.name}' for ensemble '{name}' is not written")
    for tensor in sorted(set(readers) | set(writers)):
        if tensor in outputs:
            continue
        if tensor not in ready or tensor not in readers:
            raise ModelLoadError(f"ensemble tensor '{tensor}' is unused in ensemble '{name}'")


class StepError(ModelLoadError):
    """A step check that failed on what a composing model's config leaves out (a mapped tensor, a tensor's data
    type or dims): `undeclared_in` names those models. Every other step failure is a plain ModelLoadError."""

    def __init__(self, message: str, undeclared_in: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.undeclared_in = tuple(sorted(set(undeclared_in)))


class ComposingModels(Protocol):
    """The models an ensemble's steps may run on, as its checks see them: loaded ones in the server, checked
    configs in `geserve check`."""

    def available(self, name: str) -> bool:
        """Whether the model has a version a step could run on."""
        ...

    def configs(self, name: str) -> list[mc.ModelConfig]:
        """The configs of every such version (none for an unknown model)."""
        ...

    def config(self, step: Step) -> mc.ModelConfig:
        """The config of the version the step runs on; GeserveError when there is none."""
        ...


class LoadedModels:
    """The server's view: the versions loaded now, a step's the one a request to it would reach."""

    def __init__(self, models: Mapping[str, Model]) -> None:
        self._models = models

    def available(self, name: str) -> bool:
        return _loaded(self._models, name)

    def configs(self, name: str) -> list[mc.ModelConfig]:
        model = self._models.get(name)
        return [version.config for version in model.versions.values()] if model is not None else []

    def config(self, step: Step) -> mc.ModelConfig:
        return _version(self._models, step).config


def check_steps(config: mc.ModelConfig, models: ComposingModels) -> None:
    """The checks Triton makes against the composing models' configs (ValidateEnsembleConfig): every model
    available, every input mapped once, each ensemble tensor with one data type and compatible dims, and the
    response cache only where every step could use it."""
    name = config.name
    step_models = dict.fromkeys(step.model_name for step in steps_of(config))
    response_cache.check_ensemble_steps(config, [found for model in step_models for found in models.configs(model)])
    missing = sorted(model for model in step_models if not models.available(model))
    if missing:
        raise ModelLoadError(f"ensemble {name} contains models that are not available: {', '.join(missing)}")
    batching = config.max_batch_size > 0
    tensors: dict[str, _TensorNode] = {}
    declared: list[mc.ModelInput | mc.ModelOutput] = [*config.input, *config.output]
    for tensor in declared:
        dims = tuple(tensor.reshape.shape) if tensor.HasField("reshape") else tuple(tensor.dims)
        tensors[tensor.name] = _TensorNode(name, batching, tensor.data_type, dims)
    for step in steps_of(config):
        composing = models.config(step)
        if composing.model_transaction_policy.decoupled and not config.model_transaction_policy.decoupled:
            raise ModelLoadError(
                f"ensemble {name} step {step.index} uses decoupled model {step.model_name}, so the ensemble must be "
                "decoupled too (model_transaction_policy { decoupled: true })"
            )
        if composing.max_batch_size != 0 and composing.max_batch_size < config.max_batch_size:
            raise ModelLoadError(
                f"ensemble {name} allows maximum batch size {config.max_batch_size}, but it contains model "
                f"{step.model_name} which only allows maximum batch size to be {composing.max_batch_size}"
            )
        _check_mapping(name, step, composing, tensors)


def _loaded(models: Mapping[str, Model], name: str) -> bool:
    model = models.get(name)
    return model is not None and bool(model.versions)


def _version(models: Mapping[str, Model], step: Step) -> ModelVersion:
    version = str(step.model_version) if step.model_version >= 0 else ""
    return find_version(models, step.model_name, version)


@dataclass(frozen=True, slots=True)
class _TensorNode:
    model: str
    batching: bool
    datatype: int
    dims: tuple[int, ...]

    @property
    def full_dims(self) -> tuple[int, ...]:
        return ((-1,) if self.batching else ()) + self.dims


def _same_dims(left: tuple[int, ...], right: tuple[int, ...]) -> bool:
    return len(left) == len(right) and all(a == b or a == -1 or b == -1 for a, b in zip(left, right, strict=True))


def _consistent(ensemble: str, tensor: str, known: _TensorNode, found: _TensorNode) -> None:
    prefix = f"in ensemble {ensemble}, ensemble tensor {tensor}: "
    if known.datatype != found.datatype:
        raise StepError(
            f"{prefix}inconsistent data type: {mc.DataType.Name(known.datatype)} is inferred from model "  # type: ignore[arg-type]
            f"{known.model} while {mc.DataType.Name(found.datatype)} is inferred from model {found.model}",  # type: ignore[arg-type]
            [node.model for node in (known, found) if node.datatype == mc.TYPE_INVALID],
        )
    if not _same_dims(known.dims, found.dims) and not _same_dims(known.full_dims, found.full_dims):
        raise StepError(
            f"{prefix}inconsistent shape: {list(known.full_dims)} is inferred from model {known.model} while "
            f"{list(found.full_dims)} is inferred from model {found.model}",
            [node.model for node in (known, found) if not node.dims],
        )


def _check_mapping(ensemble: str, step: Step, composing: mc.ModelConfig, tensors: dict[str, _TensorNode]) -> None:
    batching = composing.max_batch_size > 0
    inputs = {tensor.name: tensor for tensor in composing.input}
    for input_name, tensor in step.inputs.items():
        if input_name not in inputs:
            raise StepError(
                f"in ensemble {ensemble}, ensemble tensor {tensor} is mapping to non-existing input {input_name} "
                f"in model {step.model_name}",
                [step.model_name],
            )
    for declared_input in composing.input:
        if declared_input.name not in step.inputs:
            if declared_input.optional:
                continue
            raise ModelLoadError(
                f"in ensemble {ensemble}, input {declared_input.name} in model {composing.name} is not mapped to any "
                "ensemble tensors"
            )
        node = _TensorNode(step.model_name, batching, declared_input.data_type, tuple(declared_input.dims))
        _link(ensemble, step.inputs[declared_input.name], node, tensors)
    outputs = {tensor.name: tensor for tensor in composing.output}
    for output_name, tensor in step.outputs.items():
        declared_output = outputs.get(output_name)
        if declared_output is None:
            raise StepError(
                f"in ensemble {ensemble}, ensemble tensor {tensor} is mapped from non-existing output {output_name} "
                f"in model {step.model_name}",
                [step.model_name],
            )
        node = _TensorNode(step.model_name, batching, declared_output.data_type, tuple(declared_output.dims))
        _link(ensemble, tensor, node, tensors)


def _link(ensemble: str, tensor: str, node: _TensorNode, tensors: dict[str, _TensorNode]) -> None:
    known = tensors.get(tensor)
    if known is None:
        tensors[tensor] = node
    else:
        _consistent(ensemble, tensor, known, node)


# -- running an ensemble ------------------------------------------------------------------------------------


class EnsembleSteps:
    """An ensemble's stand-in for instances: it has none of its own, so it is ready while its steps' models
    are, reports no status, and stopping waits for the unary requests it is running (their steps run on the
    composing models; a decoupled ensemble's streams end with their composing models' streams)."""

    def __init__(self, steps: tuple[Step, ...], models: Mapping[str, Model]) -> None:
        self._steps = steps
        self._models = models
        self._running: set[asyncio.Task[dict[str, SharedTensor]]] = set()
        self._stopping = False

    def ready(self) -> bool:
        try:
            return not self._stopping and all(_version(self._models, step).ready for step in self._steps)
        except GeserveError:
            return False

    async def read_statuses(self) -> list[InstanceStatus]:
        return []

    def kill(self) -> None:
        self._stopping = True

    async def stop(self, timeout_s: float) -> None:
        self._stopping = True
        if self._running:
            await asyncio.wait(list(self._running), timeout=timeout_s)

    def track(self, task: asyncio.Task[dict[str, SharedTensor]]) -> None:
        """A request the ensemble runs now: `stop` waits for it."""
        self._running.add(task)
        task.add_done_callback(self._running.discard)


def step_limits(config: mc.ModelConfig) -> tuple[asyncio.Semaphore, ...]:
    """`ensemble_scheduling.max_inflight_requests`, as Triton bounds it: at most that many requests in flight at
    each step, counted across all of the ensemble's requests (one bound per step; 0: none)."""
    limit = config.ensemble_scheduling.max_inflight_requests
    if limit <= 0:
        return ()
    logger.info("Ensemble model '%s' configured with max_inflight_requests: %d", config.name, limit)
    return tuple(asyncio.Semaphore(limit) for _ in config.ensemble_scheduling.step)


class EnsembleScheduler:
    """Runs each request through the step graph: a step starts as soon as its inputs exist, so independent
    steps run side by side, each through its composing model's own scheduler (its batching and instances
    apply); the first failing step fails the request with its error. With max_inflight_requests, a step whose
    bound is reached waits (its request holds its inputs) until one of that step's requests is done."""

    def __init__(self, config: mc.ModelConfig, models: Mapping[str, Model], stats: ModelStats) -> None:
        self._name = config.name
        self._steps = steps_of(config)
        self._models = models
        self._stats = stats
        self.instances = EnsembleSteps(self._steps, models)
        self._limits = step_limits(config)

    async def execute(self, request: ScheduledRequest) -> ScheduledResponse:
        """The requested outputs once every step has run; its statistics are its steps' summed (there are no
        timestamps of its own: its steps' batches have theirs)."""
        started = time.monotonic_ns()
        timing = [0, 0, 0, 0]  # queue, compute input, infer, output: the sum over the steps
        task = asyncio.ensure_future(self._outputs(request, timing))
        self.instances.track(task)
        try:
            outputs = await task
        except GeserveError:
            self._stats.record_failure("OTHER", time.monotonic_ns() - started)
            raise
        except asyncio.CancelledError:
            self._stats.record_failure("CANCELED", time.monotonic_ns() - started)
            raise
        total = time.monotonic_ns() - started
        self._stats.record_success(RequestTiming(total, *timing))
        self._stats.record_execution(_rows(request.inputs), *timing[1:])
        return ScheduledResponse(outputs)

    async def _outputs(self, request: ScheduledRequest, timing: list[int]) -> dict[str, SharedTensor]:
        forwarded = _forwarded(request.parameters)
        flow = self._flow(dict(request.inputs), self._steps, forwarded, request.request_id, timing, chain=request.chain)
        async with contextlib.aclosing(flow):
            # The first complete set: the only one, unless a step's model became decoupled since the check.
            tensors: dict[str, SharedTensor] = await anext(flow, {})
        missing = [name for name in request.output_names if name not in tensors]
        if missing:
            raise InternalError(f"ensemble '{self._name}' did not produce output(s) {missing}")
        # The response parameters are those of the step that ran last, whose response completed the ensemble's.
        return with_parameters({name: tensors[name] for name in request.output_names}, response_parameters(tensors))

    async def stream(self, request: ScheduledRequest) -> AsyncIterator[StreamedOutputs]:
        """A decoupled ensemble: every response of a decoupled step runs the steps after it, and each time the
        requested outputs are complete they are one response; an empty final response ends the stream."""
        started = time.monotonic_ns()
        forwarded = _forwarded(request.parameters)
        try:
            flow = self._flow(
                dict(request.inputs), self._steps, forwarded, request.request_id, None, chain=request.chain
            )
            async for tensors in flow:
                outputs = {name: tensors[name] for name in request.output_names if name in tensors}
                yield with_parameters(outputs, response_parameters(tensors)), None, False
        except GeserveError as error:
            self._stats.record_failure("OTHER", time.monotonic_ns() - started)
            yield None, error, True
            return
        self._stats.record_success(RequestTiming(time.monotonic_ns() - started, 0, 0, 0, 0))
        yield None, None, True

    async def _flow(
        self,
        tensors: dict[str, SharedTensor],
        waiting: Sequence[Step],
        parameters: Parameters,
        request_id: str,
        timing: list[int] | None,
        *,
        chain: CallChain = (),
    ) -> AsyncGenerator[dict[str, SharedTensor]]:
        """The graph executor: runs the `waiting` steps as their inputs come, side by side, and yields the
        ensemble tensors once none is left to run. A decoupled step runs once the others in flight are done,
        and each of its responses runs the steps after it (one yield per complete response). Each step's
        queue and compute times are added to `timing`. A BLS request's steps are part of its `chain` of calls."""
        waiting = list(waiting)
        running: dict[asyncio.Task[ScheduledResponse], Step] = {}
        decoupled: tuple[Step, ModelVersion] | None = None
        try:
            while True:
                for step in [s for s in waiting if all(tensor in tensors for tensor in s.inputs.values())]:
                    model = _version(self._models, step)
                    if model.decoupled:
                        decoupled = decoupled or (step, model)
                        continue
                    waiting.remove(step)
                    call = self._call(step, model, tensors, parameters, request_id, chain=chain)
                    running[asyncio.ensure_future(call)] = step
                if not running:
                    break
                done, _ = await asyncio.wait(list(running), return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    step = running.pop(task)
                    response = task.result()  # a step's error fails the whole request
                    tensors = _with(tensors, step, response.outputs)
                    if timing is not None and response.timestamps is not None:
                        for index, ns in enumerate(response.timestamps.durations()):
                            timing[index] += ns
        finally:
            for task in running:
                if not task.done():
                    task.cancel()
                elif not task.cancelled():
                    task.exception()  # seen: only the first failing step fails the request
        if decoupled is None:
            yield tensors  # every step has run (what is left never gets its inputs: the config check rules it out)
            return
        step, model = decoupled
        waiting.remove(step)
        calls.check_cycle(model.name, model.version, model.instance_count, chain)
        inputs = validation.validate_inputs(_request(step, model, tensors, parameters, request_id), model)
        # A decoupled step is in flight until its final response, so it holds its place that long.
        async with self._in_flight(step):
            async for streamed, error, _ in model.scheduler.stream(
                ScheduledRequest(inputs, tuple(step.outputs), parameters, request_id, chain=chain)
            ):
                if error is not None:
                    raise error
                if streamed:
                    async for complete in self._flow(
                        _with(tensors, step, streamed), waiting, parameters, request_id, timing, chain=chain
                    ):
                        yield complete

    def _in_flight(self, step: Step) -> contextlib.AbstractAsyncContextManager[Any]:
        """A place among the step's requests in flight: waits while its max_inflight_requests are taken."""
        return self._limits[step.index] if self._limits else contextlib.nullcontext()

    async def _call(
        self,
        step: Step,
        model: ModelVersion,
        tensors: Mapping[str, SharedTensor],
        parameters: Parameters,
        request_id: str,
        *,
        chain: CallChain,
    ) -> ScheduledResponse:
        """One step through its composing model, validated as a client's request to it would be; its errors are
        the ensemble request's, word for word."""
        calls.check_cycle(model.name, model.version, model.instance_count, chain)
        inputs = validation.validate_inputs(_request(step, model, tensors, parameters, request_id), model)
        started_ns = time.monotonic_ns()
        async with self._in_flight(step):
            # Steps hand their outputs on in shared memory: the next step's worker reads them where they were written.
            response = await response_cache.execute(
                model, ScheduledRequest(inputs, tuple(step.outputs), parameters, request_id, chain=chain)
            )
        steps = traced_steps.get()
        if steps is not None:  # the request is traced: this step is a child of its trace
            marks = response.timestamps.marks() if response.timestamps is not None else ()
            steps.append(StepTrace(model.name, model.version_str, started_ns, time.monotonic_ns(), marks))
        return response


def _forwarded(parameters: Parameters) -> Parameters:
    """The request parameters an ensemble passes on to its steps: all of them, as Triton's ensemble scheduler gives
    each step's request the ensemble request's parameters (core ensemble_scheduler.cc, since core PR #261)."""
    return dict(parameters)


def _request(
    step: Step, model: ModelVersion, tensors: Mapping[str, SharedTensor], parameters: Parameters, request_id: str
) -> InferRequest:
    """The request a step makes of its composing model."""
    return InferRequest(
        step.model_name,
        str(model.version),
        tuple(_input(name, tensors[tensor]) for name, tensor in step.inputs.items()),
        id=request_id,
        parameters=dict(parameters),
    )


def _with(tensors: dict[str, SharedTensor], step: Step, outputs: Mapping[str, SharedTensor]) -> dict[str, SharedTensor]:
    """The ensemble tensors once a step's outputs are in."""
    merged = dict(tensors)
    for model_output, tensor in step.outputs.items():
        if model_output in outputs:
            merged[tensor] = outputs[model_output]
    return with_parameters(merged, response_parameters(outputs))  # the latest step's response parameters


def _input(name: str, tensor: SharedTensor) -> InferInput:
    return InferInput(name, tensor.datatype, tensor.shape, tensor)


def _rows(inputs: Mapping[str, SharedTensor]) -> int:
    first = next(iter(inputs.values()), None)
    return int(first.shape[0]) if first is not None and first.ndim else 1
