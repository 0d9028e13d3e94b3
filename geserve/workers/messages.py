"""The small control messages exchanged between the front-end process and a worker."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from geserve.errors import GeserveError
from geserve.types import InstanceStatus, ParameterValue
from geserve.workers.shm import TensorRef


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """Everything a worker needs to build its model instance; picklable under `spawn`."""

    model_name: str
    model_version: int
    instance_name: str
    backend: str
    config: bytes  # serialized inference.ModelConfig
    model_path: str
    device_id: int
    auto_complete: bool
    log_level: int
    # Set in the worker before its backend is imported (e.g. ASCEND_RT_VISIBLE_DEVICES).
    environment: tuple[tuple[str, str], ...] = ()
    # Tensor arenas in shared memory (process workers only): an input and an output arena per slot.
    arenas: tuple[str, ...] = ()
    # Placed on an accelerator (KIND_GPU): the instance reports that device's usage for metrics.
    on_device: bool = False
    # Polled for its status (device usage, the model's readiness and custom metrics).
    polled: bool = False


@dataclass(frozen=True, slots=True)
class Loaded:
    """The instance is ready; `config` is the serialized config it completed and serves."""

    config: bytes


@dataclass(frozen=True, slots=True)
class LoadFailed:
    message: str


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """One request of a batch, for backends that see requests rather than rows (python)."""

    rows: int  # its share of the batch dimension (1 for a model without one)
    request_id: str
    parameters: dict[str, ParameterValue]
    output_names: tuple[str, ...]
    stream_id: int = -1  # >= 0: its responses stream back as Partial messages (decoupled models)


@dataclass(frozen=True, slots=True)
class RunBatch:
    """Run one batch whose inputs lie in shared memory; `request_id` matches the answer to it.
    Outputs go to `output_arena`, or, when they do not fit, to a new segment named `output_overflow`."""

    request_id: int
    inputs: tuple[TensorRef, ...]
    output_names: tuple[str, ...]
    output_arena: str
    output_overflow: str
    requests: tuple[RequestInfo, ...] = ()


@dataclass(frozen=True, slots=True)
class Partial:
    """One streamed response of request `stream_id`: small outputs inline, larger ones in a segment of
    their own (refs), which the front-end unlinks after reading; or an error; `final` ends the stream."""

    stream_id: int
    outputs: dict[str, np.ndarray] | None
    refs: tuple[TensorRef, ...]
    error: GeserveError | None
    final: bool


@dataclass(frozen=True, slots=True)
class Cancel:
    """The client of streamed request `stream_id` went away."""

    stream_id: int


@dataclass(frozen=True, slots=True)
class BatchDone:
    """Where a batch's outputs lie, or the error that failed it, and when the backend ran."""

    request_id: int
    outputs: tuple[TensorRef, ...]
    error: GeserveError | None
    infer_start_ns: int
    infer_end_ns: int
    # Per request, for backends that answer requests one by one: its outputs, or its own error.
    responses: tuple[tuple[TensorRef, ...] | GeserveError, ...] | None = None


@dataclass(frozen=True, slots=True)
class Executed:
    """A batch's outputs as the scheduler receives them, or the error that failed it, and when the
    backend started and finished (time.monotonic_ns, comparable across processes)."""

    outputs: dict[str, np.ndarray] | None
    error: GeserveError | None
    infer_start_ns: int
    infer_end_ns: int
    # Per request, for backends that answer requests one by one (outputs is then None).
    responses: tuple[dict[str, np.ndarray] | GeserveError, ...] | None = None


@dataclass(frozen=True, slots=True)
class ReadStatus:
    """Ask how the instance is doing; answered with a StatusReport between batches."""


@dataclass(frozen=True, slots=True)
class StatusReport:
    status: InstanceStatus


@dataclass(frozen=True, slots=True)
class Retiring:
    """The worker is about to exit on purpose (its device failed) and should be replaced."""

    reason: str


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Unload and exit."""
