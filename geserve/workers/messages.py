"""The small control messages exchanged between the front-end process and a worker."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from geserve.backends.base import RequestResult
from geserve.errors import GeserveError
from geserve.residency import SharedTensor
from geserve.types import EMPTY_PARAMETERS, InstanceStatus, Parameters
from geserve.workers.runs import RunId
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
    log_format: str = "default"  # --log-format
    log_file: str = ""  # --log-file; empty: standard error
    # Set in the worker before its backend is imported (e.g. ASCEND_RT_VISIBLE_DEVICES).
    environment: tuple[tuple[str, str], ...] = ()
    # Shared memory (process workers only): the input arenas the worker's owner writes batches' local tensors to,
    # one per slot, and the output arena the worker holds each batch's outputs in until they are released.
    arenas: tuple[str, ...] = ()
    output_arena: str = ""
    # Placed on an accelerator (KIND_GPU): the instance reports that device's usage for metrics.
    on_device: bool = False
    # The instance group's kind as Triton names it to python models ("CPU", "GPU", "MODEL").
    kind: str = "CPU"
    # Loaded and initialized, but never given a batch (instance_group.passive).
    passive: bool = False
    # Which instance_group of the config it belongs to (its rate_limiter, for --rate-limit=execution_count).
    group: int = 0
    # Polled for its status (device usage, the model's readiness and custom metrics).
    polled: bool = False
    # The model's folder (a sequence model's initial_state/ lies there).
    model_directory: str = ""
    # The server run whose id the names of the segments the worker creates carry (process workers only).
    run: RunId | None = None
    # A python model's execution environment (EXECUTION_ENV_PATH): the interpreter the worker runs and the search
    # path it starts with; empty: the server's own.
    interpreter: str = ""
    search_path: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Loaded:
    """The instance is ready; `config` is the serialized config it completed and serves."""

    config: bytes


@dataclass(frozen=True, slots=True)
class LoadFailed:
    message: str


class RequestInfo(NamedTuple):
    """One request of a batch: its rows, and what per-request backends (python) see of it. A named tuple,
    as every batch carries one per request (tuples pickle several times faster than frozen dataclasses)."""

    rows: int  # its share of the batch dimension (1 for a model without one)
    output_names: tuple[str, ...]
    request_id: str = ""
    parameters: Parameters = EMPTY_PARAMETERS
    stream_id: int = -1  # >= 0: its responses stream back as Partial messages (decoupled models)
    # A sequence model's request: the batch slot whose implicit state it reads and writes (-1: none), and
    # SEQUENCE_* flags (a padding row of an empty slot has the slot but not SEQUENCE_READY).
    slot: int = -1
    sequence_flags: int = 0
    # Its ragged inputs' own shapes: the batch holds those inputs flattened, one request after another.
    ragged_shapes: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # >= 0: a unary request a Cancel may name while it runs (the channel's ids, shared with stream ids).
    cancel_id: int = -1


# RequestInfo.sequence_flags: the first and last request of a sequence (Triton's TRITONSERVER_REQUEST_FLAG_*
# values), and a real request rather than the padding of an empty slot.
SEQUENCE_START = 1
SEQUENCE_END = 2
SEQUENCE_READY = 4


# One input of a batch: its name, datatype and the requests' row blocks, in request order, which the worker gathers.
BatchInput = tuple[str, str, tuple[SharedTensor, ...]]


@dataclass(frozen=True, slots=True)
class RunBatch:
    """Run one batch whose inputs lie in shared memory (each given as the requests' row blocks, read where they lie);
    `batch_id` matches the answer to it and names its outputs until they are released."""

    batch_id: int
    inputs: tuple[BatchInput, ...]
    output_names: tuple[str, ...]
    requests: tuple[RequestInfo, ...]
    # Earlier batches whose outputs are read and done with, as a Release would name them: they ride along here.
    released: tuple[int, ...] = ()

    def __reduce__(self) -> tuple[Callable[..., RunBatch], tuple[object, ...]]:
        # Sent once per batch: plain tuples pickle several times faster than dataclasses and named tuples.
        fields = (self.batch_id, self.inputs, self.output_names, self.released)
        return _run_batch, (fields, tuple(map(tuple, self.requests)))


def _run_batch(fields: tuple[Any, ...], requests: tuple[tuple[Any, ...], ...]) -> RunBatch:
    batch_id, inputs, output_names, released = fields
    infos = tuple(tuple.__new__(RequestInfo, request) for request in requests)
    return RunBatch(batch_id, inputs, output_names, infos, released)


@dataclass(frozen=True, slots=True)
class Release:
    """Whoever read these batches' outputs is done with them: their place in the output arena is free again."""

    batch_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Partial:
    """One streamed response of request `stream_id`: small outputs inline, larger ones in a segment of
    their own (refs), which the front-end unlinks after reading; or an error; `final` ends the stream."""

    stream_id: int
    outputs: dict[str, np.ndarray] | None
    refs: tuple[TensorRef, ...]
    error: GeserveError | None
    final: bool
    parameters: Parameters = field(default_factory=dict)  # the response's own, as the model set them


@dataclass(frozen=True, slots=True)
class Cancel:
    """The client of a request went away: a stream (its `stream_id`) or a running unary request (its `cancel_id`)."""

    stream_id: int


# One output of one request: rows [first, first + count) of block `block` (count -1: the whole block).
RowRange = tuple[int, int, int]
# A request's outputs, each a row range of a block in shared memory; or the request's own error.
PlacedResult = tuple[RowRange, ...] | GeserveError
# One output block of a batch: the output's name, and the tensor, every request's rows of it back to back.
OutputBlock = tuple[str, SharedTensor]


def request_outputs(
    blocks: Sequence[OutputBlock], placed: Sequence[PlacedResult], lease: object = None
) -> tuple[TensorResult, ...]:
    """Each request's outputs as its row ranges of the blocks (no byte is read), held by `lease`; or its own error."""
    results: list[TensorResult] = []
    for result in placed:
        if isinstance(result, GeserveError):
            results.append(result)
            continue
        outputs: dict[str, SharedTensor] = {}
        for block, first, rows in result:
            name, tensor = blocks[block]
            own = tensor if rows < 0 else tensor.rows(first, rows)
            own.lease = lease
            outputs[name] = own
        results.append(outputs)
    return tuple(results)


@dataclass(frozen=True, slots=True)
class BatchPlaced:
    """The answer to RunBatch: the output blocks in shared memory (usually one per output, holding every
    request's rows back to back), every request's result as row ranges of them, and when the backend ran."""

    batch_id: int
    blocks: tuple[OutputBlock, ...]
    results: tuple[PlacedResult, ...]
    infer_start_ns: int
    infer_end_ns: int
    # Each request's response parameters, as the model set them; empty when no request has any.
    parameters: tuple[Parameters, ...] = ()

    def __reduce__(self) -> tuple[type[BatchPlaced], tuple[object, ...]]:
        # Sent once per batch: rebuilt from its fields, not through the dataclass's generic state.
        fields = (self.batch_id, self.blocks, self.results, self.infer_start_ns, self.infer_end_ns)
        return BatchPlaced, (*fields, self.parameters)


# A request's result as the scheduler receives it: its outputs (tensors in shared memory, or in this process for an
# instance on a thread), or its own error.
TensorResult = dict[str, SharedTensor] | GeserveError


@dataclass(frozen=True, slots=True)
class BatchResult:
    """A batch as the scheduler receives it: every request's result, in order, and when the backend started and
    finished (time.monotonic_ns, comparable across processes). A request that streams (decoupled model) has an
    empty result here: its responses come on its stream."""

    results: tuple[TensorResult, ...]
    infer_start_ns: int
    infer_end_ns: int


@dataclass(frozen=True, slots=True)
class RunResult:
    """A batch as a backend answered it in the worker: every request's outputs as arrays, or its own error."""

    results: tuple[RequestResult, ...]
    infer_start_ns: int
    infer_end_ns: int


@dataclass(frozen=True, slots=True)
class BlsCall:
    """A python model's BLS request (`InferenceRequest.exec`): its inputs in a segment the front-end reads
    and unlinks; answered by one BlsReply, or by several ending with a final one when `decoupled`."""

    call_id: int
    model_name: str
    model_version: str  # "": the latest ready version
    inputs: tuple[TensorRef, ...]
    output_names: tuple[str, ...]  # empty: every output
    request_id: str
    parameters: Parameters
    timeout_us: int  # 0: none
    decoupled: bool


@dataclass(frozen=True, slots=True)
class BlsCancel:
    """A python model cancelled a decoupled BLS call (`ResponseIterator.cancel()`, or dropped it unfinished): the
    callee's request is cancelled, and the call ends with a final reply."""

    call_id: int


@dataclass(frozen=True, slots=True)
class BlsReply:
    """One response to a BlsCall: outputs in a segment of its own (the worker reads and unlinks it), or the
    error the call met; `final` ends the call."""

    call_id: int
    outputs: tuple[TensorRef, ...]
    error: GeserveError | None
    final: bool
    parameters: Parameters = field(default_factory=dict)  # the response's own


@dataclass(frozen=True, slots=True)
class ControlCall:
    """A python model's `load_model` / `unload_model` / `is_model_ready` for the server's model repository;
    answered by one ControlReply."""

    call_id: int  # from the same counter as the worker's BlsCalls
    action: str  # "load_model", "unload_model" or "is_model_ready"
    model_name: str
    model_version: str = ""  # is_model_ready: "" for the latest
    config: str = ""  # load_model: the model config as JSON, "" for the repository's
    files: Mapping[str, bytes] = field(default_factory=dict)  # load_model: "file:<path>" -> contents
    unload_dependents: bool = False


@dataclass(frozen=True, slots=True)
class ControlReply:
    """The answer to a ControlCall: whether the model is ready (is_model_ready), or the error the call met."""

    call_id: int
    ready: bool
    error: GeserveError | None


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
