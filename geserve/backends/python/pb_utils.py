"""`triton_python_backend_utils` as model.py files written for Triton's python backend import it."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from geserve._generated import model_config_pb2 as mc
from geserve.backends.python.model_config import ModelConfig as ModelConfig  # noqa: PLC0414 - Triton exports it here
from geserve.codecs import bytes as bytes_codec
from geserve.codecs import dtypes

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2
# PreferredMemory's kinds, the two the python backend exports, with its values (pb_preferred_memory.h).
TRITONSERVER_MEMORY_GPU = 0
TRITONSERVER_MEMORY_CPU = 1
_MEMORY_NAMES = {
    TRITONSERVER_MEMORY_GPU: "TRITONSERVER_MEMORY_GPU",
    TRITONSERVER_MEMORY_CPU: "TRITONSERVER_MEMORY_CPU",
}

_logger = logging.getLogger("geserve.python_model")


# -- data types ------------------------------------------------------------------------------------

TRITON_STRING_TO_NUMPY: dict[str, Any] = {
    mc.DataType.Name(dt.config): (np.object_ if dt.wire == "BYTES" else dt.numpy.type)  # type: ignore[arg-type]
    for dt in dtypes.all_types()
    if dt.wire != "BF16"
}


def triton_to_numpy_type(data_type: int) -> Any:
    """TRITONSERVER_DataType (the config's TYPE_* numbers) -> numpy type."""
    datatype = dtypes.from_config(data_type)
    return np.object_ if datatype.wire == "BYTES" else datatype.numpy.type


def numpy_to_triton_type(data_type: Any) -> int | None:
    try:
        return dtypes.from_numpy(np.dtype(data_type)).config
    except Exception:
        return None


def triton_string_to_numpy(triton_type_string: str) -> Any:
    return TRITON_STRING_TO_NUMPY[triton_type_string]


def serialize_byte_tensor(input_tensor: np.ndarray) -> np.ndarray | None:
    """Elements framed with their 4-byte little-endian lengths, as a uint8 array."""
    if input_tensor.size == 0:
        return None
    return np.frombuffer(bytes_codec.serialize(bytes_codec.to_bytes_array(input_tensor)), dtype=np.uint8)


def deserialize_bytes_tensor(encoded_tensor: bytes | np.ndarray) -> np.ndarray:
    data = encoded_tensor.tobytes() if isinstance(encoded_tensor, np.ndarray) else encoded_tensor
    return bytes_codec.deserialize(data)


# -- errors ----------------------------------------------------------------------------------------


class TritonError(Exception):
    """An error a response carries; `code` is one of the class constants."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        super().__init__(message)
        self._message = message
        self._code = code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


class TritonModelException(Exception):  # noqa: N818 - Triton's name
    """Raised by models (e.g. from initialize) to report a failure."""


# -- tensors ---------------------------------------------------------------------------------------


class Tensor:
    """A named numpy array; BYTES tensors are object arrays of bytes."""

    def __init__(self, name: str, tensor: Any) -> None:
        array = np.asarray(tensor)
        if array.dtype.kind in ("S", "U"):
            array = bytes_codec.to_bytes_array(array)
        self._name = name
        self._array = array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def triton_dtype(self) -> int:
        return dtypes.from_numpy(self._array.dtype).config

    def is_cpu(self) -> bool:
        return True

    def to_dlpack(self) -> Any:
        return self._array.__dlpack__()

    def __dlpack__(self, stream: Any = None) -> Any:
        return self._array.__dlpack__()

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._array.__dlpack_device__()

    @staticmethod
    def from_dlpack(name: str, capsule: Any) -> Tensor:
        return Tensor(name, np.from_dlpack(capsule))


# -- requests and responses ------------------------------------------------------------------------


class InferenceResponse:
    def __init__(
        self,
        output_tensors: Sequence[Tensor] | None = None,
        error: TritonError | None = None,
        parameters: Mapping[str, Any] | str | None = None,
    ) -> None:
        self._tensors = list(output_tensors or [])
        self._error = error
        self._parameters = json.dumps(_checked_parameters(parameters))

    def output_tensors(self) -> list[Tensor]:
        return self._tensors

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def parameters(self) -> str:
        return self._parameters


_INT64 = range(-(1 << 63), 1 << 63)


def _checked_parameters(parameters: Any) -> dict[str, bool | int | str]:
    """A response's parameters checked as Triton's python backend checks them: a dict (or its JSON text)
    of str keys to bool, int or str values, the only types a response parameter has in Triton."""
    if isinstance(parameters, str):
        try:
            parameters = json.loads(parameters) if parameters else {}
        except ValueError as error:
            raise TritonModelException(f"Expect parameters to be a JSON object: {error}") from None
    if parameters is None:
        return {}
    if not isinstance(parameters, Mapping):
        raise TritonModelException(f"Expect dict, got {type(parameters)}")
    checked: dict[str, bool | int | str] = {}
    for key, value in parameters.items():
        if not isinstance(key, str):
            raise TritonModelException(f"Expect parameters keys to have type str, found type {type(key)}")
        if not isinstance(value, bool | int | str):
            raise TritonModelException(f"Expect parameters values to have type bool/int/str, found type {type(value)}")
        if isinstance(value, int) and not isinstance(value, bool) and value not in _INT64:
            raise TritonModelException(f"parameter '{key}' = {value} does not fit in an int64")
        checked[key] = value
    return checked


# What the worker does with a response: (response or None, final flag).
ResponseHandler = Callable[[InferenceResponse | None, bool], None]


class InferenceResponseSender:
    """Sends a request's responses, the last with the FINAL flag: any number for a decoupled model, exactly one for
    any other (python_backend's response_sender.cc: its checks and its texts)."""

    def __init__(self, handler: ResponseHandler, cancelled: Callable[[], bool], decoupled: bool = True) -> None:
        self._handler = handler
        self._cancelled = cancelled
        self._decoupled = decoupled
        self._closed = False
        self._responses = 0
        self._lock = threading.Lock()

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        if flags not in (0, TRITONSERVER_RESPONSE_COMPLETE_FINAL):
            raise TritonModelException("Unable to send response. Unsupported flag provided.")
        if flags == 0 and response is None:
            raise TritonModelException(
                "Inference Response object must be provided when the response flags is set to zero."
            )
        final = flags == TRITONSERVER_RESPONSE_COMPLETE_FINAL
        with self._lock:
            if not self._decoupled:
                if response is not None and self._responses > 0:
                    raise TritonModelException(
                        "Unable to send response. Non-decoupled model cannot send more than one response."
                    )
                if response is None and self._responses == 0:
                    raise TritonModelException(
                        "Unable to send response. Non-decoupled model cannot send complete final before sending a "
                        "response."
                    )
            if self._closed:
                raise TritonModelException("Unable to send response. Response sender has been closed.")
            self._closed = final
            self._responses += response is not None
        self._handler(response, final)

    def is_cancelled(self) -> bool:
        return self._cancelled()

    def _close(self) -> bool:
        """Close the sender for the server's own final answer (an error): whether it was still open."""
        with self._lock:
            was_open, self._closed = not self._closed, True
        return was_open


class PreferredMemory:
    """Where a BLS request would like its outputs; geserve's are always in CPU memory, so GPU is refused."""

    def __init__(self, preferred_memory_type: int, preferred_device_id: int = 0) -> None:
        if preferred_memory_type not in _MEMORY_NAMES:
            raise TypeError(
                f"PreferredMemory(): unknown memory type {preferred_memory_type!r}; "
                "use pb_utils.TRITONSERVER_MEMORY_CPU"
            )
        self._type = int(preferred_memory_type)
        self._device_id = int(preferred_device_id)


class InferenceTrace:
    """A request's trace as a BLS request passes it on; geserve keeps no OpenTelemetry context, so it is None."""

    def __init__(self, context: str | None = None) -> None:
        self._context = context or None

    def get_context(self) -> str | None:
        return self._context


# How a BLS request reaches the server: set in a worker process (BlsClient.call); None elsewhere.
BlsCaller = Callable[["InferenceRequest", bool], Any]
# How load_model / unload_model / is_model_ready reach the server: (action, model name, arguments) -> readiness.
ModelControl = Callable[[str, str, Mapping[str, Any]], bool]
_bls_callers: list[BlsCaller] = []
_model_controls: list[ModelControl] = []


def set_bls_caller(caller: BlsCaller | None, control: ModelControl | None = None) -> None:
    """Where `InferenceRequest.exec` sends requests and the model control functions their calls (geserve's worker
    sets them; not part of Triton's API)."""
    _bls_callers[:] = [caller] if caller is not None else []
    _model_controls[:] = [control] if control is not None else []


class InferenceRequest:
    """A request the server hands to `execute`, or one a model builds and sends with `exec` (BLS)."""

    def __init__(  # noqa: PLR0917 - Triton's signature
        self,
        model_name: str = "",
        inputs: Sequence[Tensor] = (),
        requested_output_names: Sequence[str] = (),
        request_id: str = "",
        correlation_id: int | str = 0,
        flags: int = 0,
        timeout: int = 0,
        parameters: Mapping[str, Any] | str | None = None,
        model_version: int = -1,
        preferred_memory: PreferredMemory | None = None,
        trace: InferenceTrace | None = None,
    ) -> None:
        if preferred_memory is not None and not isinstance(preferred_memory, PreferredMemory):
            raise TypeError("InferenceRequest(): preferred_memory must be a pb_utils.PreferredMemory")
        if preferred_memory is not None and preferred_memory._type == TRITONSERVER_MEMORY_GPU:
            raise TritonModelException(
                f"InferenceRequest(): preferred_memory TRITONSERVER_MEMORY_GPU (device {preferred_memory._device_id}) "
                "is not supported by geserve: BLS outputs are in CPU memory; use pb_utils.TRITONSERVER_MEMORY_CPU"
            )
        if trace is not None and not isinstance(trace, InferenceTrace):
            raise TypeError("InferenceRequest(): trace must be a pb_utils.InferenceTrace")
        self._model_name = model_name
        self._model_version = int(model_version)
        self._inputs = list(inputs)
        self._requested_output_names = list(requested_output_names)
        self._request_id = request_id
        self._correlation_id = correlation_id
        self._flags = flags
        self._timeout = timeout
        self._parameters = parameters if isinstance(parameters, str) else json.dumps(dict(parameters or {}))
        self._sender: InferenceResponseSender | None = None
        self._cancelled: Callable[[], bool] = lambda: False
        self._preferred_memory = preferred_memory
        self._trace = trace or InferenceTrace()

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def request_id(self) -> str:
        return self._request_id

    def correlation_id(self) -> int | str:
        return self._correlation_id

    def flags(self) -> int:
        return self._flags

    def set_flags(self, flags: int) -> None:
        self._flags = int(flags)

    def trace(self) -> InferenceTrace:
        return self._trace

    def timeout(self) -> int:
        return self._timeout

    def parameters(self) -> str:
        return self._parameters

    def requested_output_names(self) -> list[str]:
        return self._requested_output_names

    def model_name(self) -> str:
        return self._model_name

    def get_response_sender(self) -> InferenceResponseSender:
        if self._sender is None:
            raise TritonModelException("this request has no response sender")
        return self._sender

    def is_cancelled(self) -> bool:
        return self._cancelled()

    def set_release_flags(self, flags: int) -> None:
        if flags & TRITONSERVER_REQUEST_RELEASE_RESCHEDULE:
            raise TritonModelException(
                "request rescheduling (TRITONSERVER_REQUEST_RELEASE_RESCHEDULE) is not supported by geserve"
            )

    def model_version(self) -> int:
        return self._model_version

    def exec(self, decoupled: bool = False) -> Any:
        """Run this request on model `model_name` and wait: its InferenceResponse (errors in `error()`), or
        with `decoupled` an iterator of responses, the last one carrying the final flag."""
        if not _bls_callers:
            raise TritonModelException("BLS requests (InferenceRequest.exec) need a model served by geserve's workers")
        return _bls_callers[0](self, decoupled)

    async def async_exec(self, decoupled: bool = False) -> Any:
        """`exec` without blocking the model's event loop: the wait happens on a thread."""
        return await asyncio.get_running_loop().run_in_executor(None, self.exec, decoupled)

    def attach(self, sender: InferenceResponseSender, cancelled: Callable[[], bool]) -> None:
        """Give a server-made request its response sender (not part of Triton's API)."""
        self._sender = sender
        self._cancelled = cancelled


def get_input_tensor_by_name(inference_request: InferenceRequest, name: str) -> Tensor | None:
    return next((tensor for tensor in inference_request.inputs() if tensor.name() == name), None)


def get_output_tensor_by_name(inference_response: InferenceResponse, name: str) -> Tensor | None:
    return next((tensor for tensor in inference_response.output_tensors() if tensor.name() == name), None)


def get_input_config_by_name(model_config: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    return next((dict(entry) for entry in model_config.get("input", []) if entry.get("name") == name), None)


def get_output_config_by_name(model_config: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    return next((dict(entry) for entry in model_config.get("output", []) if entry.get("name") == name), None)


def using_decoupled_model_transaction_policy(model_config: Mapping[str, Any]) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


# -- logging ---------------------------------------------------------------------------------------


class Logger:
    """Model logging, into the server's log with the worker's model and instance tags; a line names the model's own
    file and line, as Triton's does."""

    class LogLevel:
        INFO = 0
        WARNING = 1
        ERROR = 2
        VERBOSE = 3

    # Triton exports the levels on the class too (pybind's export_values): Logger.log(msg, Logger.INFO).
    INFO = LogLevel.INFO
    WARNING = LogLevel.WARNING
    ERROR = LogLevel.ERROR
    VERBOSE = LogLevel.VERBOSE

    @staticmethod
    def log(message: str, level: int = 0) -> None:
        levels = {0: logging.INFO, 1: logging.WARNING, 2: logging.ERROR, 3: logging.DEBUG}
        _logger.log(levels.get(level, logging.INFO), "%s", message, stacklevel=2)

    @staticmethod
    def log_info(message: str) -> None:
        _logger.info("%s", message, stacklevel=2)

    @staticmethod
    def log_warn(message: str) -> None:
        _logger.warning("%s", message, stacklevel=2)

    @staticmethod
    def log_error(message: str) -> None:
        _logger.error("%s", message, stacklevel=2)

    @staticmethod
    def log_verbose(message: str) -> None:
        _logger.debug("%s", message, stacklevel=2)


# -- model control (Triton 23.07+: load_model, unload_model, is_model_ready) --------------------------


def _control(action: str, what: str, model_name: str, arguments: Mapping[str, Any]) -> bool:
    if not isinstance(model_name, str):
        raise TypeError(f"{action}(): model_name must be a str")
    if not _model_controls:
        raise TritonModelException(f"{action}() needs a model served by geserve's workers")
    try:
        return _model_controls[0](action, model_name, arguments)
    except TritonModelException as error:
        raise TritonModelException(f"Failed to {what}: {error}") from None


def load_model(model_name: str, config: str = "", files: Mapping[str, bytes] | None = None) -> None:
    """Load (or reload) a model as the repository extension's load does: `config` a model config as JSON, `files`
    "file:<path>" -> contents of the model's files. Returns once the model is loaded."""
    if not isinstance(config, str):
        raise TypeError("load_model(): config must be a str")
    if files is not None and not isinstance(files, Mapping):
        raise TritonModelException(
            f"failed to load model '{model_name}', files should be a dictionary of file paths and file contents"
        )
    contents = dict(files or {})
    for key, value in contents.items():
        if not isinstance(key, str) or not isinstance(value, bytes):
            raise TypeError("load_model(): files maps str paths to bytes contents")
    _control("load_model", "load model", model_name, {"config": config, "files": contents})


def unload_model(model_name: str, unload_dependents: bool = False) -> None:
    """Unload a model; as Triton's, returns once the model stops serving, without waiting for its requests."""
    _control("unload_model", "unload model", model_name, {"unload_dependents": bool(unload_dependents)})


def is_model_ready(model_name: str, model_version: str = "") -> bool:
    """Whether the model (version, "" for the latest) is ready to serve."""
    if not isinstance(model_version, str):
        raise TypeError("is_model_ready(): model_version must be a str")
    if model_version and (not model_version.isdigit() or not model_version.isascii()):
        raise TritonModelException(
            f"Failed to check model readiness: failed to get model version from specified version string "
            f"'{model_version}', version should be an integral value > 0"
        )
    return _control("is_model_ready", "check model readiness", model_name, {"model_version": model_version})


# -- custom metrics --------------------------------------------------------------------------------


class _Series:
    """One labelled series of a family, as /metrics shows it; Metric objects with the same labels share it."""

    def __init__(self, labels: dict[str, str], buckets: list[float]) -> None:
        self.labels = labels
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.value = 0.0
        self.set_ns = 0  # when the value last changed: across instances, the latest gauge value wins


class _Registered:
    """A family name as the server registers it: its kind, the first description given, and its series."""

    def __init__(self, name: str, description: str, kind: int) -> None:
        self.name, self.description, self.kind = name, description, kind
        self.metrics: list[_Series] = []


_KINDS = {0: "COUNTER", 1: "GAUGE", 2: "HISTOGRAM"}
_FAMILY_DELETED = (
    "Invalid metric operation as the corresponding 'MetricFamily' has been deleted. The 'MetricFamily' object should "
    "be deleted AFTER its corresponding 'Metric' objects have been deleted."
)


class MetricFamily:
    """A custom metric family; its metrics appear on the server's /metrics, read at each scrape. Triton's checks and
    texts (python_backend metric_family.cc, metric.cc; core metric_family.cc): a name registered again with the same
    kind is the same family (its first description kept), with another kind it is refused; deleting the family
    removes its metrics, and a Metric used after that is refused."""

    COUNTER = 0
    GAUGE = 1
    HISTOGRAM = 2
    families: dict[str, _Registered] = {}
    _lock = threading.Lock()

    def __init__(self, name: str, description: str, kind: int) -> None:
        if kind not in _KINDS:
            raise TritonModelException(f"Error when creating MetricFamily: unknown metric kind {kind!r}")
        with MetricFamily._lock:
            registered = MetricFamily.families.get(name)
            if registered is None:
                registered = MetricFamily.families[name] = _Registered(name, description, kind)
            elif registered.kind != kind:
                raise TritonModelException(
                    "Error when creating MetricFamily: Family name already exists with different type"
                )
        self.name = name
        self.description = registered.description
        self.kind = kind
        self._registered = registered
        self._own: list[_Series] = []  # the series this object's Metric calls made
        self._deleted = _Flag()

    def Metric(self, labels: Any = None, buckets: Any = None) -> Metric:  # noqa: N802 - Triton's name
        if labels is None:
            labels = {}
        if not isinstance(labels, dict):
            raise TritonModelException("Failed to create metric. Labels must be a dictionary.")
        if buckets is not None and not isinstance(buckets, list):
            raise TritonModelException("Failed to create metric. Buckets must be a list.")
        if self.kind != self.HISTOGRAM and buckets is not None:
            raise TritonModelException("Failed to create metric. Unexpected buckets found.")
        if self.kind == self.HISTOGRAM and buckets is None:
            raise TritonModelException("Failed to create metric. Missing required buckets.")
        if any(not isinstance(key, str) or not isinstance(value, str) for key, value in labels.items()):
            raise TritonModelException("Error when creating Metric: attempt to access JSON non-string as string")
        bounds = [float(bound) for bound in buckets or ()]
        if any(later <= earlier for earlier, later in itertools.pairwise(bounds)):
            raise TritonModelException("Error when creating Metric: Bucket Boundaries must be strictly sorted")
        with MetricFamily._lock:
            series = next((found for found in self._registered.metrics if found.labels == labels), None)
            if series is None:  # the same labels again: the same series, as prometheus' Family.Add
                series = _Series(dict(labels), bounds)
                self._registered.metrics.append(series)
            self._own.append(series)
        return Metric(self.kind, series, self._deleted)

    def __del__(self) -> None:
        # As Triton: the family's metrics go with it (and leave /metrics); the name stays registered.
        if not hasattr(self, "_deleted"):  # refused in __init__
            return
        self._deleted.set = True
        with MetricFamily._lock:
            owned = {id(series) for series in self._own}
            self._registered.metrics[:] = [series for series in self._registered.metrics if id(series) not in owned]


class _Flag:
    __slots__ = ("set",)

    def __init__(self) -> None:
        self.set = False


class Metric:
    """One series of a family, as a model holds it: Triton's operations, each refused for a kind without it."""

    def __init__(self, kind: int, series: _Series, family_deleted: _Flag) -> None:
        self._kind = kind
        self._series = series
        self._family_deleted = family_deleted

    def _check(self, action: str, operation: str, allowed: tuple[int, ...]) -> None:
        if self._family_deleted.set:
            raise TritonModelException(f"Failed to {action} metric value: {_FAMILY_DELETED}")
        if self._kind not in allowed:
            raise TritonModelException(
                f"Failed to {action} metric value: TRITONSERVER_METRIC_KIND_{_KINDS[self._kind]} does not support "
                f"{operation}"
            )

    def increment(self, value: float) -> None:
        self._check("increment", "Increment", (MetricFamily.COUNTER, MetricFamily.GAUGE))
        if self._kind == MetricFamily.COUNTER and value < 0:
            raise TritonModelException(
                "Failed to increment metric value: TRITONSERVER_METRIC_KIND_COUNTER can only be incremented "
                "monotonically by non-negative values."
            )
        self._series.value += value
        self._series.set_ns = time.time_ns()

    def set(self, value: float) -> None:
        self._check("set", "Set", (MetricFamily.GAUGE,))
        self._series.value = value
        self._series.set_ns = time.time_ns()

    def observe(self, value: float) -> None:
        self._check("observe", "Observe", (MetricFamily.HISTOGRAM,))
        series = self._series
        index = next((i for i, bound in enumerate(series.buckets) if value <= bound), len(series.buckets))
        series.counts[index] += 1
        series.sum += value
        series.value += 1

    def value(self) -> float:
        self._check("get", "Value", (MetricFamily.COUNTER, MetricFamily.GAUGE))
        return self._series.value
