"""The trace extension: global and per-model settings, sampling, and TIMESTAMPS traces to a file, the log or OTLP."""

from __future__ import annotations

import importlib.util
import itertools
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import orjson

from geserve.core.trace_file import TraceCollection, TraceFile
from geserve.errors import InvalidArgumentError, UnsupportedError
from geserve.types import TraceContext, TraceMark, TraceRecord

if TYPE_CHECKING:
    from geserve.core.trace_otel import SpanExport

TRACE_FILE_REFUSAL = "trace file location can not be updated through network protocol"
LEVELS = ("OFF", "TIMESTAMPS", "TENSORS")
MODES = ("triton", "opentelemetry")
OPENTELEMETRY = "opentelemetry"
# Trace mode opentelemetry's own settings, by the names Triton's /v2/trace/setting shows them (its config map):
# set at startup only, as Triton's ("does not support configuration of the opentelemetry trace settings during a
# Triton run", docs/user_guide/trace.md). `resource` is a list, one KEY=VALUE each.
OTEL_KEYS = ("url", "resource", "bsp_max_queue_size", "bsp_schedule_delay", "bsp_max_export_batch_size")
# The batch span processor's defaults, Triton's or those of the OTEL_BSP_* variables when set
# (TritonParser::ProcessOpenTelemetryBatchSpanProcessorArgs, src/command_line_parser.cc).
_BSP_DEFAULTS = {
    "bsp_max_queue_size": ("OTEL_BSP_MAX_QUEUE_SIZE", "2048"),
    "bsp_schedule_delay": ("OTEL_BSP_SCHEDULE_DELAY", "5000"),
    "bsp_max_export_batch_size": ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "512"),
}
_TRITON_KEYS = ("log_frequency", "trace_file")  # trace mode triton's own settings
_KEYS = ("trace_level", "trace_rate", "trace_count", *_TRITON_KEYS, "trace_mode", *OTEL_KEYS)
OTEL_EXTRA = "geserve[otel]"
# What mode opentelemetry imports (geserve.core.trace_otel); the `otel` extra installs them.
_OTEL_MODULES = ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http.trace_exporter")
trace_logger = logging.getLogger("geserve.trace")


@dataclass(slots=True)
class _Settings:
    values: dict[str, list[str] | str] = field(default_factory=dict)


def _defaults(mode: str = "triton") -> dict[str, list[str] | str]:
    """Each setting's value before any is given; a mode shows its own settings only, as Triton's (HandleTrace)."""
    if mode == OPENTELEMETRY:
        return {"trace_level": ["OFF"], "trace_rate": "1000", "trace_count": "-1", "trace_mode": mode}
    return {
        "trace_level": ["OFF"],
        "trace_rate": "1000",
        "trace_count": "-1",
        "log_frequency": "0",
        "trace_file": "",
        "trace_mode": mode,
    }


def _bsp_defaults(given: Mapping[str, Any]) -> dict[str, list[str] | str]:
    """The batch span processor settings not `given`, from the OTEL_BSP_* variables or Triton's defaults."""
    defaults: dict[str, list[str] | str] = {}
    for key, (variable, default) in _BSP_DEFAULTS.items():
        if key in given:
            continue
        value = os.environ.get(variable, default)
        try:
            defaults[key] = _checked(key, value)
        except InvalidArgumentError as error:
            raise InvalidArgumentError(f"{variable}: {error.message}") from None
    return defaults


def otel_installed() -> bool:
    """Whether what trace mode opentelemetry exports with (the `otel` extra) can be imported."""
    for module in _OTEL_MODULES:
        try:
            if importlib.util.find_spec(module) is None:
                return False
        except ImportError:  # a parent package is missing (or broken)
            return False
    return True


def _as_list(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list | tuple) and all(isinstance(item, str) for item in value):
        return list(value)
    raise InvalidArgumentError(f"expect a string or a list of strings, got {value!r}")


def _checked(key: str, value: Any, zero_rate: bool = False) -> list[str] | str:
    """A setting's value as kept, or the error for a bad one; `zero_rate`: trace_rate 0 is allowed (a startup
    setting of mode opentelemetry: only the requests that carry a client's trace context are traced)."""
    if key == "trace_level":
        levels = _as_list(value)
        unknown = [level for level in levels if level not in LEVELS]
        if unknown or not levels:
            raise InvalidArgumentError(f"invalid trace level {unknown or levels}; expected a subset of {list(LEVELS)}")
        if "TENSORS" in levels:
            raise UnsupportedError("trace level TENSORS is not supported by geserve; use TIMESTAMPS")
        return ["OFF"] if levels == ["OFF"] else [level for level in levels if level != "OFF"]
    text = _as_list(value)
    if key == "resource":
        for entry in text:
            name, equals, _ = entry.partition("=")
            if not equals or not name:
                raise InvalidArgumentError(f"invalid trace resource '{entry}': expected <key>=<value>")
        return text
    if len(text) != 1:
        raise InvalidArgumentError(f"expect a single value for '{key}'")
    single = text[0]
    if key in ("trace_rate", "trace_count", "log_frequency") or key in _BSP_DEFAULTS:
        try:
            number = int(single)
        except ValueError:
            raise InvalidArgumentError(f"unable to parse '{key}', got: {single}") from None
        if (
            (key == "trace_rate" and number < (0 if zero_rate else 1))
            or (key == "trace_count" and number < -1)
            or (key == "log_frequency" and number < 0)
        ):
            raise InvalidArgumentError(f"invalid value {number} for '{key}'")
        # Triton's are uint32; OpenTelemetry's batch span processor takes none of them 0.
        if key in _BSP_DEFAULTS and not 0 < number < 1 << 32:
            raise InvalidArgumentError(f"invalid value {number} for '{key}': expected 1 to {(1 << 32) - 1}")
        return str(number)
    if key == "trace_mode" and single not in MODES:
        raise InvalidArgumentError(
            f'invalid value for trace mode option: {single}. Available options are "triton" and "opentelemetry"'
        )
    return single


class TraceController:
    """Settings as Triton keeps them (per model, falling back to the global ones), which requests to trace
    (every `trace_rate`-th request under a setting, `trace_count` times; -1: no limit) and where finished
    traces go. A model with settings of its own samples and collects under them; every other model shares
    the global setting's counters, as Triton's. The mode (triton: the trace file or the log; opentelemetry:
    spans over OTLP/HTTP) is set at startup, with its own settings."""

    def __init__(self, initial: Mapping[str, Any] | None = None) -> None:
        initial = dict(initial or {})
        self.mode = str(_checked("trace_mode", initial.get("trace_mode", "triton")))
        if self.mode == OPENTELEMETRY and not otel_installed():
            raise UnsupportedError(
                f"trace mode opentelemetry needs the OpenTelemetry SDK and its OTLP/HTTP exporter, which are not "
                f"installed: pip install '{OTEL_EXTRA}'"
            )
        self._global = _Settings(_defaults(self.mode))
        self._models: dict[str, _Settings] = {}
        self._seen: dict[str | None, int] = {}
        self._remaining: dict[str | None, int] = {}
        self._collections: dict[str | None, TraceCollection] = {}
        self._ids = itertools.count(1)
        self.active = False  # any level other than OFF anywhere: lets untraced requests skip all of this
        if initial:
            self.update(None, initial, from_network=False)
        self._spans: SpanExport | None = None
        if self.mode == OPENTELEMETRY:
            self._global.values.update(_bsp_defaults(self._global.values))
            queue, batch = (
                int(str(self._global.values[key])) for key in ("bsp_max_queue_size", "bsp_max_export_batch_size")
            )
            if batch > queue:  # Triton drops the spans past the queue; OpenTelemetry's Python SDK refuses
                raise InvalidArgumentError(
                    f"bsp_max_export_batch_size ({batch}) must be less than or equal to bsp_max_queue_size ({queue})"
                )
        path = str(self._global.values.get("trace_file", ""))
        # The file is set at startup only (the network may not move it), so there is one.
        self._file = TraceFile(path) if path else None

    def open(self) -> None:
        """Start exporting (mode opentelemetry: the span processor's thread); the server calls it once, where the
        engine runs, and `close` ends it. A controller that only checks settings never opens."""
        if self.mode == OPENTELEMETRY and self._spans is None:
            from geserve.core.trace_otel import SpanExport  # the `otel` extra's modules, loaded in that mode only

            self._spans = SpanExport(self._global.values)

    def _scope(self, model: str | None) -> str | None:
        """Whose setting applies to `model`: its own when it has any, else the global one (None)."""
        return model if model is not None and self._models.get(model, _Settings()).values else None

    def settings(self, model: str | None = None) -> dict[str, list[str] | str]:
        merged = dict(self._global.values)
        if model is not None and model in self._models:
            merged.update(self._models[model].values)
        remaining = self._remaining.get(self._scope(model))
        if remaining is not None and merged["trace_count"] != "-1":
            merged["trace_count"] = str(remaining)  # Triton reports the traces still to be sampled
        return merged

    def update(self, model: str | None, changes: Mapping[str, Any], from_network: bool = True) -> dict[str, Any]:
        """Apply settings; a None value (an empty list) clears a model's own setting or resets a
        global one. Nothing changes when any value is bad."""
        staged: dict[str, list[str] | str | None] = {}
        for key, value in changes.items():
            if key not in _KEYS:
                raise InvalidArgumentError(f"unknown trace setting '{key}'")
            cleared = value is None or value == []
            if key == "trace_file" and from_network:
                raise UnsupportedError(TRACE_FILE_REFUSAL)
            if key in OTEL_KEYS and from_network:
                raise UnsupportedError(
                    f"'{key}' can not be updated through network protocol: trace mode opentelemetry's settings are "
                    f"set at startup (--trace-config opentelemetry,{key}=...)"
                )
            if key == "trace_mode" and not cleared and _as_list(value) != [self.mode]:
                raise UnsupportedError(
                    f"trace mode can not be changed while the server runs: it traces in mode '{self.mode}', "
                    "set at startup (--trace-config mode=...)"
                )
            other_mode = "opentelemetry" if key in OTEL_KEYS else "triton" if key in _TRITON_KEYS else self.mode
            if other_mode != self.mode:
                raise UnsupportedError(
                    f"'{key}' is a setting of trace mode {other_mode}, and the server traces in mode {self.mode}"
                )
            zero_rate = not from_network and self.mode == OPENTELEMETRY
            staged[key] = None if cleared else _checked(key, value, zero_rate)
        target = self._global if model is None else self._models.setdefault(model, _Settings())
        for key, checked in staged.items():
            default = _defaults(self.mode).get(key) if model is None else None
            if checked is None:
                if default is not None:
                    target.values[key] = default
                else:
                    target.values.pop(key, None)
            else:
                target.values[key] = checked
        self.active = any(
            settings.values.get("trace_level", ["OFF"]) != ["OFF"]
            for settings in (self._global, *self._models.values())
        )
        # A new setting starts afresh, as Triton's replaced one: its sampling restarts (a new trace_count means
        # "this many more") and what the old one collected is written out.
        replaced = [model] if model is not None else [None, *self._models]
        for scope in replaced:
            self._remaining.pop(scope, None)
            self._seen.pop(scope, None)
            collection = self._collections.pop(scope, None)
            if collection is not None:
                collection.flush()
        return self.settings(model)

    def start(self, model: str, version: str, request_id: str, context: TraceContext | None = None) -> Trace | None:
        """A trace for this request, or None when it is not sampled. In mode opentelemetry a request that carries a
        client's valid trace context is traced whatever the rate and count, and continues it (Triton's force_sample:
        TraceManager::GetTraceStartOptions, src/tracer.cc:294-318, and TraceSetting::SampleTrace, tracer.cc:1135)."""
        if not self.active:
            return None
        scope = self._scope(model)
        settings = self.settings(model)
        if settings["trace_level"] == ["OFF"]:
            return None
        if context is not None and (self.mode != OPENTELEMETRY or context.span() is None):
            context = None  # mode triton reads no context; an invalid one parents nothing, as Triton's propagator
        rate = int(str(settings["trace_rate"]))
        sampled = False
        if rate != 0:  # 0 (a startup setting of mode opentelemetry): only requests with a context are traced
            remaining = self._remaining.get(scope, int(str(settings["trace_count"])))
            if remaining == 0 and context is None:
                return None
            seen = self._seen[scope] = self._seen.get(scope, 0) + 1
            # The rate-th, the 2*rate-th...: Triton's sampling, which counts a forced request too; a hit when no
            # traces are left to take is none.
            sampled = seen % rate == 0 and remaining != 0
            if sampled:
                self._remaining[scope] = remaining - 1 if remaining > 0 else -1
        if not sampled and context is None:
            return None
        if self._file is not None:
            self._collection(scope, settings).created += 1
        return Trace(next(self._ids), model, version, request_id, scope, self._ids, context=context)

    def record(self, record: TraceRecord) -> None:
        """A finished trace (the front-end's moments included): as spans in mode opentelemetry; else to the trace
        file, or the log without one."""
        if self.mode == OPENTELEMETRY:
            if self._spans is None:
                raise RuntimeError("a trace recorded before TraceController.open() started exporting")
            self._spans.export(record)
            return
        if self._file is None:
            trace_logger.info("trace %s", orjson.dumps(_log_record(record)).decode())
            return
        settings = self.settings(record.scope)
        self._collection(record.scope, settings).add(record, self._remaining.get(record.scope) == 0)

    def close(self) -> None:
        """Write every trace collected and end the file, or export the spans still queued (blocks until done)."""
        for collection in self._collections.values():
            collection.flush()
        self._collections.clear()
        if self._file is not None:
            self._file.close()
        if self._spans is not None:
            self._spans.close()
            self._spans = None

    def _collection(self, scope: str | None, settings: Mapping[str, list[str] | str]) -> TraceCollection:
        collection = self._collections.get(scope)
        if collection is None:
            assert self._file is not None
            collection = self._collections[scope] = TraceCollection(self._file, int(str(settings["log_frequency"])))
        return collection


def _log_record(record: TraceRecord) -> dict[str, Any]:
    logged: dict[str, Any] = {
        "id": record.id,
        "model_name": record.model_name,
        "model_version": record.model_version,
        "request_id": record.request_id,
        "timestamps": [{"name": name, "ns": ns} for name, ns in record.timestamps],
    }
    if record.parent_id:
        logged["parent_id"] = record.parent_id
    if record.children:
        logged["children"] = [_log_record(child) for child in record.children]
    return logged


class StepTrace(NamedTuple):
    """One step an ensemble ran for a traced request: its model, when the call started and ended, and its
    batch's timestamps."""

    model_name: str
    model_version: str
    started_ns: int
    ended_ns: int
    marks: tuple[TraceMark, ...]


# Where the ensemble a traced request runs notes its steps (None: the request is not traced). A context
# variable, so that the steps' tasks, which copy their context when the ensemble starts them, note theirs.
traced_steps: ContextVar[list[StepTrace] | None] = ContextVar("traced_steps", default=None)


@dataclass(slots=True)
class Trace:
    """One traced request's timestamps as the core takes them (time.monotonic_ns, as the scheduler and
    workers take them); `scope` is whose setting sampled it, `ids` where its children's ids come from."""

    id: int
    model_name: str
    model_version: str
    request_id: str
    scope: str | None = None
    ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    timestamps: list[TraceMark] = field(default_factory=list)
    steps: list[StepTrace] = field(default_factory=list)
    context: TraceContext | None = None  # the client's, which this trace continues (mode opentelemetry)

    def mark(self, name: str, ns: int) -> None:
        self.timestamps.append((name, ns))

    def add(self, marks: Sequence[TraceMark]) -> None:
        self.timestamps.extend(marks)

    def finished(self) -> TraceRecord:
        """What the front-end gets with the response, to add its moments to."""
        children = tuple(
            TraceRecord(
                next(self.ids),
                step.model_name,
                step.model_version,
                self.request_id,
                (("REQUEST_START", step.started_ns), *step.marks, ("REQUEST_END", step.ended_ns)),
                self.scope,
                self.id,
            )
            for step in self.steps
        )
        timestamps = tuple(self.timestamps)
        return TraceRecord(
            self.id,
            self.model_name,
            self.model_version,
            self.request_id,
            timestamps,
            self.scope,
            0,
            children,
            self.context,
        )
