"""The small control messages exchanged between the front-end process and a worker."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from geserve.errors import GeserveError


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


@dataclass(frozen=True, slots=True)
class Loaded:
    """The instance is ready; `config` is the serialized config it completed and serves."""

    config: bytes


@dataclass(frozen=True, slots=True)
class LoadFailed:
    message: str


@dataclass(frozen=True, slots=True)
class Execute:
    """Run one batch; `request_id` matches the answer to the request."""

    request_id: int
    inputs: dict[str, np.ndarray]
    output_names: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Executed:
    """The answer to Execute: outputs, or the error that failed the whole batch, and when the
    backend started and finished (time.monotonic_ns, comparable across processes)."""

    request_id: int
    outputs: dict[str, np.ndarray] | None
    error: GeserveError | None
    infer_start_ns: int
    infer_end_ns: int


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Unload and exit."""
