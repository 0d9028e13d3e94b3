"""The Backend protocol every execution backend implements, and the optional ones some add."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from geserve._generated import model_config_pb2 as mc
from geserve.errors import GeserveError, InternalError
from geserve.types import CustomMetric, DeviceUsage, Parameters

# (output name, KServe datatype, shape) -> an array to write that output into, possibly in the
# worker's shared-memory output arena, so the result needs no further copy.
OutputAllocator = Callable[[str, str, tuple[int, ...]], np.ndarray]


class DeviceFaultError(InternalError):
    """The device or runtime under an instance failed (e.g. an NPU's 5xxxxx errors): the batch fails
    with this message, and the worker process exits so that a fresh one takes its place."""


class Backend(Protocol):
    """One model instance on one device.

    Lifecycle: `load` -> `complete_config` -> any number of `execute` -> `unload`. All calls
    happen in the worker that owns the instance, never on the front-end's event loop.
    """

    def load(self, config: mc.ModelConfig, model_path: Path, device_id: int) -> None:
        """Open the model file (or folder) at `model_path` on `device_id`."""

    def complete_config(self, config: mc.ModelConfig, auto_complete: bool) -> None:
        """With `auto_complete`, fill what the config leaves out from the model file (inputs,
        outputs, dtypes, dims, max_batch_size); then check the config against the model file and
        raise ModelLoadError naming both where they disagree."""

    def execute(
        self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str], allocate: OutputAllocator | None = None
    ) -> dict[str, np.ndarray]:
        """Run one batch; inputs and outputs carry the batch dimension when the model batches. A backend
        that produces outputs by copying may copy them into arrays from `allocate`, when given."""

    def unload(self) -> None:
        """Release everything `load` acquired."""


class PipelinedBackend(Protocol):
    """A backend whose device runs one batch while the host copies in the next. A batch is staged (its
    inputs copied to the device; an earlier batch may still be running), launched (once the batch before
    it has finished), then finished (waited for, its outputs copied out). At most two batches are staged
    or running at once, and they finish in the order they were launched."""

    def stage(self, inputs: Mapping[str, np.ndarray]) -> object:
        """Copy a batch's inputs to the device; returns what `launch` and `finish` take."""

    def stage_blocks(self, inputs: Mapping[str, Sequence[np.ndarray]]) -> object:
        """`stage` for a batch given as each input's row blocks, in order: each copied to its rows on the device,
        never joined in host memory."""

    def launch(self, staged: object) -> None:
        """Start the staged batch on the device, without waiting for it."""

    def wait(self, staged: object) -> None:
        """Block until the launched batch is done on the device, without holding the GIL; called from a
        thread of its own while the worker's main thread stages the next batch. Never raises: a failure
        is kept for `finish` to raise."""

    def finish(
        self, staged: object, output_names: Sequence[str], allocate: OutputAllocator | None = None
    ) -> dict[str, np.ndarray]:
        """Wait for a launched batch (unless `wait` did) and return its outputs (copied into arrays from
        `allocate`, when given)."""

    def discard(self, staged: object) -> None:
        """Give up a staged batch that will not be launched."""


@dataclass(frozen=True, slots=True)
class BackendRequest:
    """One request of a batch, for backends that take a batch as its requests (Triton's python backend)."""

    inputs: Mapping[str, np.ndarray]
    request_id: str
    parameters: Parameters
    output_names: tuple[str, ...]
    cancelled: Callable[[], bool]


# A response of request `index` (outputs or an error), and whether it is that request's last.
ResponseEmitter = Callable[[int, Mapping[str, np.ndarray] | None, GeserveError | None, bool], None]
RequestResult = dict[str, np.ndarray] | GeserveError


class RequestBackend(Protocol):
    """A backend that runs a batch request by request and may answer each with its own error."""

    def execute_requests(self, requests: Sequence[BackendRequest], emit: ResponseEmitter) -> list[RequestResult] | None:
        """One result per request, in order; or None for a decoupled model, which answers each
        request through `emit`, any number of times, the last with the final flag (possibly after
        this call has returned)."""


class DeviceReporter(Protocol):
    """A backend on an accelerator that can say how busy and how full it is."""

    def device_usage(self) -> DeviceUsage | None: ...


class ModelHost(Protocol):
    """A backend that runs a model's own code (Triton's python backend): the model learns which instance
    it is, and reports its own readiness and metrics."""

    def describe_instance(self, name: str, kind: str) -> None:
        """The instance's name and kind ("CPU", "GPU", "MODEL"); called before `load`."""

    def model_ready(self) -> bool: ...

    def custom_metrics(self) -> list[CustomMetric]: ...


@dataclass(frozen=True, slots=True)
class Capabilities:
    """One backend object, and the same object typed by each optional protocol its registry entry says it
    implements (None for those it does not): callers test a field, never the object's attributes."""

    backend: Backend
    pipelined: PipelinedBackend | None = None
    per_request: RequestBackend | None = None
    device: DeviceReporter | None = None
    model: ModelHost | None = None
