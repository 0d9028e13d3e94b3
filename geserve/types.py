"""The core data types every layer shares: requests, responses and their tensors, metadata and statistics snapshots."""

from __future__ import annotations

import pickle
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import numpy as np

from geserve.codecs import dtypes
from geserve.errors import GeserveError
from geserve.residency import SharedTensor

# Values a request or tensor parameter may carry on either wire protocol.
ParameterValue = bool | int | float | str
Parameters = Mapping[str, ParameterValue]
# The instances (model name, version, instance name) that wait, each in a BLS call, for a request to be answered:
# the chain of calls that led to it, outermost first, its caller last. A client's requests have none.
CallChain = tuple[tuple[str, int, str], ...]


# A W3C traceparent (https://www.w3.org/TR/trace-context/#traceparent-header), as OpenTelemetry's propagator reads
# it: version ff is invalid, version 00 has nothing after the flags, a later version may.
_TRACEPARENT = re.compile(r"^\s*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?\s*$")


class TraceContext(NamedTuple):
    """The W3C trace context a client sent with a request (HTTP headers, gRPC metadata), as received: in trace mode
    opentelemetry, the parent of the request's spans (the engine checks it; unchecked, it is only carried)."""

    traceparent: str
    tracestate: str = ""

    def span(self) -> tuple[int, int, int] | None:
        """The client's span the traceparent names (trace id, span id, trace flags); None when it names none."""
        found = _TRACEPARENT.match(self.traceparent)
        if found is None:
            return None
        version, trace_id, span_id, flags, rest = found.groups()
        if version == "ff" or (version == "00" and rest) or trace_id == "0" * 32 or span_id == "0" * 16:
            return None
        return int(trace_id, 16), int(span_id, 16), int(flags, 16)


def merge_chains(chains: Iterable[CallChain]) -> CallChain:
    """One chain that holds each version as many times as the chain holding it most does: what a batch of requests
    from several chains waits for (an instance running it holds them all)."""
    merged: list[tuple[str, int, str]] = []
    for chain in chains:
        for entry in dict.fromkeys(chain):
            missing = chain.count(entry) - merged.count(entry)
            merged.extend([entry] * max(missing, 0))
    return tuple(merged)


EMPTY_PARAMETERS: Parameters = {}
# Request parameters the server acts on itself (scheduling, sequences, the response's encoding): a model
# sees the others. An ensemble passes the scheduling and sequence ones on to its steps.
SCHEDULING_PARAMETERS = ("sequence_id", "sequence_start", "sequence_end", "priority", "timeout")
SERVER_PARAMETERS = frozenset((*SCHEDULING_PARAMETERS, "binary_data_output"))


_Tensor = TypeVar("_Tensor")


class ModelOutputs(dict[str, _Tensor]):
    """A response's output tensors by name (arrays in a worker, shared tensors in the engine) with the response
    parameters its model set (a python model's `InferenceResponse(parameters=...)`); they ride with the tensors from
    the worker to the front-end."""

    __slots__ = ("parameters",)

    def __init__(self, tensors: Mapping[str, _Tensor], parameters: Parameters) -> None:
        super().__init__(tensors)
        self.parameters = parameters

    def __reduce__(self) -> tuple[Any, ...]:
        return (ModelOutputs, (dict(self), dict(self.parameters)))


def response_parameters(outputs: object) -> Parameters:
    """The response parameters that came with `outputs` (none for a plain dict, None or an error)."""
    return outputs.parameters if isinstance(outputs, ModelOutputs) else EMPTY_PARAMETERS


def with_parameters(outputs: dict[str, _Tensor], parameters: Parameters) -> dict[str, _Tensor]:
    """`outputs` carrying `parameters`; the plain dict itself when there are none."""
    return ModelOutputs(outputs, parameters) if parameters else outputs


@dataclass(frozen=True, slots=True)
class InferInput:
    """One input tensor as decoded by a front-end.

    `data` is a typed numpy array (JSON, typed protobuf contents), the raw little-endian
    bytes of a binary tensor, or bytes already in shared memory (a request arena); validation
    checks raw bytes once the expected byte size is known, without copying.
    """

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: np.ndarray | memoryview | SharedTensor
    parameters: Parameters = field(default_factory=dict)

    def __reduce__(self) -> tuple[Any, ...]:
        # Raw bytes cross to the engine as a pickle buffer (out of band, not copied into the pickle).
        return (_input, (self.name, self.datatype, self.shape, _picklable(self.data), self.parameters))


@dataclass(frozen=True, slots=True)
class RequestedOutput:
    """An output the client asked for, with its per-output parameters (e.g. binary_data)."""

    name: str
    parameters: Parameters = field(default_factory=dict)

    def __reduce__(self) -> tuple[Any, ...]:
        return (RequestedOutput, (self.name, self.parameters))  # the dataclass's own state handling is slow


@dataclass(frozen=True, slots=True)
class InferRequest:
    """A wire-independent inference request; `model_version` "" means the policy's choice."""

    model_name: str
    model_version: str
    inputs: tuple[InferInput, ...]
    outputs: tuple[RequestedOutput, ...] = ()
    id: str = ""
    parameters: Parameters = field(default_factory=dict)
    # A raw binary request's body (HTTP, header length 0): the bytes of the model's one input, which
    # admission shapes per the config of the version it finds; `inputs` is then empty.
    raw_body: memoryview | SharedTensor | None = None
    trace_context: TraceContext | None = None  # the client's `traceparent` and `tracestate`, when it sent one

    def __reduce__(self) -> tuple[Any, ...]:
        raw = pickle.PickleBuffer(self.raw_body) if isinstance(self.raw_body, memoryview) else self.raw_body
        fields = (self.model_name, self.model_version, self.inputs, self.outputs, self.id, self.parameters)
        return (_request, (*fields, raw, self.trace_context))


@dataclass(frozen=True, slots=True)
class OutputTensor:
    """One output tensor of a response; BYTES outputs are object arrays of bytes."""

    name: str
    datatype: str
    data: np.ndarray
    # Set when the output went to client shared memory: the front-ends then send no data for it.
    parameters: Parameters = field(default_factory=dict)

    def __reduce__(self) -> tuple[Any, ...]:
        return (OutputTensor, (self.name, self.datatype, self.data, self.parameters))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def in_shared_memory(self) -> bool:
        return "shared_memory_region" in self.parameters


# One trace timestamp: Triton's name for the moment and time.monotonic_ns (CLOCK_MONOTONIC, one clock for
# every process of the machine, as Triton's steady_clock).
TraceMark = tuple[str, int]


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """A sampled request's trace: what the core saw, and then the front-end's receive and send moments.
    `scope` is whose trace settings sampled it (a model with settings of its own, or None: the global ones);
    `context` the client's trace context it continues (trace mode opentelemetry: its spans' parent)."""

    id: int
    model_name: str
    model_version: str
    request_id: str
    timestamps: tuple[TraceMark, ...]
    scope: str | None = None
    parent_id: int = 0
    children: tuple[TraceRecord, ...] = ()  # an ensemble's: one per step it ran, each naming this one its parent
    context: TraceContext | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        fields = (self.id, self.model_name, self.model_version, self.request_id, self.timestamps)
        return (TraceRecord, (*fields, self.scope, self.parent_id, self.children, self.context))

    def around(self, before: tuple[TraceMark, ...], after: tuple[TraceMark, ...]) -> TraceRecord:
        """This trace with the front-end's marks: those taken before the core saw the request, then those after."""
        return TraceRecord(
            self.id,
            self.model_name,
            self.model_version,
            self.request_id,
            (*before, *self.timestamps, *after),
            self.scope,
            self.parent_id,
            self.children,
            self.context,
        )


@dataclass(frozen=True, slots=True)
class InferResponse:
    """The answer to one InferRequest, outputs in the order they were requested; `trace` when it was sampled
    (the front-end adds its moments and hands it back to be written)."""

    model_name: str
    model_version: str
    outputs: tuple[OutputTensor, ...]
    id: str = ""
    parameters: Parameters = field(default_factory=dict)
    trace: TraceRecord | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        fields = (self.model_name, self.model_version, self.outputs, self.id, self.parameters)
        return (InferResponse, (*fields, self.trace))


@dataclass(frozen=True, slots=True)
class TensorMetadata:
    """Name, datatype and shape of a model input or output as clients see it."""

    name: str
    datatype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ModelMetadata:
    """What `GET /v2/models/<m>` and gRPC ModelMetadata answer."""

    name: str
    versions: tuple[str, ...]
    platform: str
    inputs: tuple[TensorMetadata, ...]
    outputs: tuple[TensorMetadata, ...]


@dataclass(frozen=True, slots=True)
class RequestTiming:
    """Where one request's time went, in ns; the compute figures are those of its batch."""

    total_ns: int
    queue_ns: int
    compute_input_ns: int
    compute_infer_ns: int
    compute_output_ns: int


@dataclass(frozen=True, slots=True)
class DeviceUsage:
    """One accelerator's memory and load, as its backend reads them (for the nv_gpu_* gauges)."""

    device_id: int
    memory_total_bytes: int
    memory_used_bytes: int
    utilization: float | None  # 0..1; None where the runtime cannot tell


@dataclass(frozen=True, slots=True)
class StreamedResponse:
    """One message of a streamed (decoupled) answer: a response, or an error, or neither when only
    `final` is news."""

    response: InferResponse | None
    error: GeserveError | None
    final: bool

    def __reduce__(self) -> tuple[Any, ...]:
        return (StreamedResponse, (self.response, self.error, self.final))


@dataclass(frozen=True, slots=True)
class CustomMetric:
    """One series of a metric family a model defines (pb_utils.MetricFamily)."""

    family: str
    description: str
    kind: str  # "counter", "gauge" or "histogram"
    labels: tuple[tuple[str, str], ...]
    value: float
    buckets: tuple[float, ...] = ()
    bucket_counts: tuple[int, ...] = ()  # per bucket, then above the last; not cumulative
    sum: float = 0.0
    set_ns: int = 0  # a gauge: when its value was last changed (wall clock), which of its instances' values is latest


@dataclass(frozen=True, slots=True)
class InstanceStatus:
    """What a worker reports between batches: its device, whether its model says it is ready, and the
    model's own metrics."""

    device: DeviceUsage | None = None
    ready: bool = True
    metrics: tuple[CustomMetric, ...] = ()


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A config input or output, resolved once at load so requests are checked cheaply."""

    name: str
    dtype: dtypes.DataType
    dims: tuple[int, ...]
    reshape: tuple[int, ...] | None
    optional: bool
    batched: bool

    @property
    def wire_shape(self) -> tuple[int, ...]:
        """The shape clients see: -1 for the batch dimension first when the model batches."""
        return ((-1,) if self.batched else ()) + self.dims


@dataclass(frozen=True, slots=True)
class ServerMetadata:
    """The server metadata endpoint's answer."""

    name: str
    version: str
    extensions: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class DurationSnapshot:
    """A count and a cumulative duration, as Triton's StatisticDuration."""

    count: int
    ns: int


@dataclass(frozen=True, slots=True)
class SummarySnapshot:
    """One latency summary of a version: quantile values over the last minute, cumulative sum and count (µs)."""

    family: str
    quantiles: tuple[tuple[float, float], ...]  # (quantile, value)
    sum_us: float
    count: int


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """The first-response histogram of a version: bounds (ms), cumulative counts per bound then +Inf, sum (ms)."""

    bounds_ms: tuple[float, ...]
    cumulative: tuple[int, ...]
    sum_ms: float


# The served config's parameter saying why a `ge` model version runs with ONNX Runtime instead of on an NPU.
NPU_FALLBACK_PARAMETER = "npu_fallback"


@dataclass(frozen=True, slots=True)
class VersionSnapshot:
    """A loaded version's counters at one moment: what the metrics publish for it."""

    name: str
    version: int
    metric_tags: tuple[tuple[str, str], ...]
    inference_count: int
    execution_count: int
    success: DurationSnapshot
    queue: DurationSnapshot
    compute_input: DurationSnapshot
    compute_infer: DurationSnapshot
    compute_output: DurationSnapshot
    failures: tuple[tuple[str, int], ...]  # (reason, count), every reason even at zero
    pending: int
    load_duration_s: float
    summaries: tuple[SummarySnapshot, ...] = ()  # when latency summaries are on
    histogram: HistogramSnapshot | None = None  # when latency histograms are on
    # Its response cache hits and misses; None when the version does not use the response cache.
    cache: tuple[DurationSnapshot, DurationSnapshot] | None = None
    npu_fallback: str = ""  # why a `ge` version runs with ONNX Runtime instead of on an NPU; "" when it does not


@dataclass(frozen=True, slots=True)
class CacheSnapshot:
    """The response cache as a whole at one moment: what Triton's local cache publishes (nv_cache_*)."""

    entries: int
    lookups: int
    hits: int
    misses: int
    evictions: int
    lookup_ns: int
    insertion_ns: int
    utilization: float  # used bytes / size, in [0.0, 1.0]


def _picklable(data: np.ndarray | memoryview | SharedTensor) -> np.ndarray | pickle.PickleBuffer | SharedTensor:
    return pickle.PickleBuffer(data) if isinstance(data, memoryview) else data


def _as_view(data: Any) -> memoryview:
    """What an unpickled buffer arrives as (a view of the frame, or bytes when it was small) as a memoryview."""
    return data if isinstance(data, memoryview) else memoryview(data)


def _input(name: str, datatype: str, shape: tuple[int, ...], data: Any, parameters: Parameters) -> InferInput:
    kept = data if isinstance(data, np.ndarray | SharedTensor) else _as_view(data)
    return InferInput(name, datatype, shape, kept, parameters)


def _request(  # noqa: PLR0917 - a pickle reconstructor: called with positional arguments
    name: str,
    version: str,
    inputs: tuple[InferInput, ...],
    outputs: tuple[RequestedOutput, ...],
    request_id: str,
    parameters: Parameters,
    raw: Any,
    trace_context: TraceContext | None = None,
) -> InferRequest:
    body = raw if raw is None or isinstance(raw, SharedTensor) else _as_view(raw)
    return InferRequest(name, version, inputs, outputs, request_id, parameters, body, trace_context)
