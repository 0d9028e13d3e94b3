"""The small control messages exchanged between the front-end process and a worker."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from geserve.errors import GeserveError
from geserve.types import DeviceUsage
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


@dataclass(frozen=True, slots=True)
class Loaded:
    """The instance is ready; `config` is the serialized config it completed and serves."""

    config: bytes


@dataclass(frozen=True, slots=True)
class LoadFailed:
    message: str


@dataclass(frozen=True, slots=True)
class RunBatch:
    """Run one batch whose inputs lie in shared memory; `request_id` matches the answer to it.
    Outputs go to `output_arena`, or, when they do not fit, to a new segment named `output_overflow`."""

    request_id: int
    inputs: tuple[TensorRef, ...]
    output_names: tuple[str, ...]
    output_arena: str
    output_overflow: str


@dataclass(frozen=True, slots=True)
class BatchDone:
    """Where a batch's outputs lie, or the error that failed it, and when the backend ran."""

    request_id: int
    outputs: tuple[TensorRef, ...]
    error: GeserveError | None
    infer_start_ns: int
    infer_end_ns: int


@dataclass(frozen=True, slots=True)
class Executed:
    """A batch's outputs as the scheduler receives them, or the error that failed it, and when the
    backend started and finished (time.monotonic_ns, comparable across processes)."""

    outputs: dict[str, np.ndarray] | None
    error: GeserveError | None
    infer_start_ns: int
    infer_end_ns: int


@dataclass(frozen=True, slots=True)
class ReadDevice:
    """Ask for the instance's device usage; answered with a DeviceReport between batches."""


@dataclass(frozen=True, slots=True)
class DeviceReport:
    usage: DeviceUsage | None


@dataclass(frozen=True, slots=True)
class Retiring:
    """The worker is about to exit on purpose (its device failed) and should be replaced."""

    reason: str


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Unload and exit."""
