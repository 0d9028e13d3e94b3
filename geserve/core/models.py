"""Loaded models and their versions: config, tensor specs, scheduler, instances, readiness."""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from geserve import snapshots
from geserve._generated import model_config_pb2 as mc
from geserve.batching.lifecycle import InstanceControl
from geserve.batching.request import ScheduledRequest, ScheduledResponse
from geserve.codecs import dtypes
from geserve.core.stats import ModelStats
from geserve.errors import GeserveError
from geserve.residency import SharedTensor
from geserve.types import NPU_FALLBACK_PARAMETER, InstanceStatus, ModelMetadata, TensorMetadata, TensorSpec

logger = logging.getLogger(__name__)

# Numbers every load of every version: a request checked against one load is checked again if another serves it.
_LOADS = itertools.count(1)

# One response of a decoupled model: its outputs (or None), its error (or None), and whether it is the last.
StreamedOutputs = tuple[dict[str, SharedTensor] | None, GeserveError | None, bool]


def _tensor_specs(tensors: list[mc.ModelInput] | list[mc.ModelOutput], batched: bool) -> dict[str, TensorSpec]:
    specs = {}
    for tensor in tensors:
        reshape = tuple(tensor.reshape.shape) if tensor.HasField("reshape") else None
        optional = bool(getattr(tensor, "optional", False))
        specs[tensor.name] = TensorSpec(
            tensor.name, dtypes.from_config(tensor.data_type), tuple(tensor.dims), reshape, optional, batched
        )
    return specs


class ModelVersion:
    """One served version of a model: the scheduler its requests go through, and its instances (an
    ensemble's stand for its steps), which decide its readiness and its end."""

    def __init__(
        self,
        config: mc.ModelConfig,
        version: int,
        scheduler: ModelScheduler,
        instances: InstanceControl,
        stats: ModelStats,
    ) -> None:
        self.name = config.name
        self.version = version
        self.version_str = str(version)
        self.load = next(_LOADS)  # this load's own number: a reload of the version gets another
        self.config = config
        self.scheduler = scheduler
        self._instances = instances
        self.stats = stats
        self.max_batch_size = config.max_batch_size
        self.decoupled = config.model_transaction_policy.decoupled
        self.labels: dict[str, list[str]] = {}  # per output, from its label_filename (classification)
        # Set when the config enables the response cache and the server has one (core.response_cache).
        self.response_cache: VersionCache | None = None
        # How many instances serve it (None: not known, an ensemble's steps): BLS call chains are checked against it.
        self.instance_count: int | None = None
        batched = config.max_batch_size > 0
        self.inputs = _tensor_specs(list(config.input), batched)
        self.outputs = _tensor_specs(list(config.output), batched)
        self.output_names = tuple(self.outputs)
        self.platform = config.platform or config.backend
        self.input_metadata = tuple(TensorMetadata(s.name, s.dtype.wire, s.wire_shape) for s in self.inputs.values())
        self.output_metadata = tuple(TensorMetadata(s.name, s.dtype.wire, s.wire_shape) for s in self.outputs.values())

    @property
    def ready(self) -> bool:
        return self._instances.ready()

    @property
    def npu_fallback(self) -> str:
        """Why this `ge` version runs with ONNX Runtime instead of on an NPU; "" when it does not."""
        parameters = self.config.parameters
        return parameters[NPU_FALLBACK_PARAMETER].string_value if NPU_FALLBACK_PARAMETER in parameters else ""

    async def read_statuses(self) -> list[InstanceStatus]:
        """What its instances report between batches (device usage, readiness, custom metrics)."""
        return await self._instances.read_statuses()

    def kill(self) -> None:
        """Stop its instances at once, without draining."""
        self._instances.kill()

    def metadata(self, versions: tuple[str, ...]) -> ModelMetadata:
        return ModelMetadata(self.name, versions, self.platform, self.input_metadata, self.output_metadata)

    async def stop(self, timeout_s: float) -> None:
        """Let the requests already admitted finish (up to `timeout_s`), then stop the instances."""
        await self._instances.stop(timeout_s)


class VersionCache(Protocol):
    """The response cache as a version sees it: what answers its requests, from the cache or its scheduler. A
    protocol, so that the cache may know versions and versions need not know the cache."""

    async def execute(self, version: ModelVersion, request: ScheduledRequest, started_ns: int) -> ScheduledResponse:
        """The request's outputs, from the cache or else from the version's scheduler (then cached)."""
        ...


class ModelScheduler(Protocol):
    """What feeds a version's requests to its instances: the dynamic or sequence batcher, or an ensemble's steps."""

    async def execute(self, request: ScheduledRequest) -> ScheduledResponse:
        """The request's outputs, with the timestamps of its batch."""
        ...

    def stream(self, request: ScheduledRequest) -> AsyncIterator[StreamedOutputs]:
        """Every response of a request to a decoupled model: (outputs or None, an error or None, final)."""
        ...


@dataclass(slots=True)
class Model:
    """A model name in the repository: its loaded versions, or why it could not be loaded."""

    name: str
    versions: dict[int, ModelVersion] = field(default_factory=dict)
    reason: str = ""
    unloaded: bool = False  # through the repository API, or gone from a polled repository
    unloaded_versions: tuple[int, ...] = ()

    def ready_versions(self) -> list[ModelVersion]:
        return [self.versions[v] for v in sorted(self.versions) if self.versions[v].ready]


def find_version(models: Mapping[str, Model], name: str, version: str = "") -> ModelVersion:
    """The version a request addresses (the latest ready one without a number); Triton's errors for unknown
    models and versions."""
    found = snapshots.find_version(models, name, version)
    assert isinstance(found, ModelVersion)
    return found
