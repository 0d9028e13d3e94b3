"""The trace extension: global and per-model settings, sampling, and TIMESTAMPS traces to the trace file or log."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import orjson

from geserve.core.trace_file import TraceCollection, TraceFile
from geserve.errors import InvalidArgumentError, UnsupportedError
from geserve.types import TraceMark, TraceRecord

TRACE_FILE_REFUSAL = "trace file location can not be updated through network protocol"
LEVELS = ("OFF", "TIMESTAMPS", "TENSORS")
_KEYS = ("trace_level", "trace_rate", "trace_count", "log_frequency", "trace_file", "trace_mode")
trace_logger = logging.getLogger("geserve.trace")


@dataclass(slots=True)
class _Settings:
    values: dict[str, list[str] | str] = field(default_factory=dict)


def _defaults() -> dict[str, list[str] | str]:
    return {
        "trace_level": ["OFF"],
        "trace_rate": "1000",
        "trace_count": "-1",
        "log_frequency": "0",
        "trace_file": "",
        "trace_mode": "triton",
    }


def _as_list(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list | tuple) and all(isinstance(item, str) for item in value):
        return list(value)
    raise InvalidArgumentError(f"expect a string or a list of strings, got {value!r}")


def _checked(key: str, value: Any) -> list[str] | str:
    if key == "trace_level":
        levels = _as_list(value)
        unknown = [level for level in levels if level not in LEVELS]
        if unknown or not levels:
            raise InvalidArgumentError(f"invalid trace level {unknown or levels}; expected a subset of {list(LEVELS)}")
        if "TENSORS" in levels:
            raise UnsupportedError("trace level TENSORS is not supported by geserve; use TIMESTAMPS")
        return ["OFF"] if levels == ["OFF"] else [level for level in levels if level != "OFF"]
    text = _as_list(value)
    if len(text) != 1:
        raise InvalidArgumentError(f"expect a single value for '{key}'")
    single = text[0]
    if key in ("trace_rate", "trace_count", "log_frequency"):
        try:
            number = int(single)
        except ValueError:
            raise InvalidArgumentError(f"unable to parse '{key}', got: {single}") from None
        if (
            (key == "trace_rate" and number < 1)
            or (key == "trace_count" and number < -1)
            or (key == "log_frequency" and number < 0)
        ):
            raise InvalidArgumentError(f"invalid value {number} for '{key}'")
        return str(number)
    if key == "trace_mode" and single != "triton":
        raise UnsupportedError(f"trace mode '{single}' is not supported by geserve; only 'triton'")
    return single


class TraceController:
    """Settings as Triton keeps them (per model, falling back to the global ones), which requests to trace
    (every `trace_rate`-th request under a setting, `trace_count` times; -1: no limit) and where finished
    traces go. A model with settings of its own samples and collects under them; every other model shares
    the global setting's counters, as Triton's."""

    def __init__(self, initial: Mapping[str, Any] | None = None) -> None:
        self._global = _Settings(_defaults())
        self._models: dict[str, _Settings] = {}
        self._seen: dict[str | None, int] = {}
        self._remaining: dict[str | None, int] = {}
        self._collections: dict[str | None, TraceCollection] = {}
        self._ids = itertools.count(1)
        self.active = False  # any level other than OFF anywhere: lets untraced requests skip all of this
        if initial:
            self.update(None, dict(initial), from_network=False)
        path = str(self._global.values["trace_file"])
        # The file is set at startup only (the network may not move it), so there is one.
        self._file = TraceFile(path) if path else None

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
            if key == "trace_file" and from_network:
                raise UnsupportedError(TRACE_FILE_REFUSAL)
            staged[key] = None if value is None or value == [] else _checked(key, value)
        target = self._global if model is None else self._models.setdefault(model, _Settings())
        for key, checked in staged.items():
            if checked is None:
                if model is None:
                    target.values[key] = _defaults()[key]
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

    def start(self, model: str, version: str, request_id: str) -> Trace | None:
        """A trace for this request, or None when it is not sampled."""
        if not self.active:
            return None
        scope = self._scope(model)
        settings = self.settings(model)
        if settings["trace_level"] == ["OFF"]:
            return None
        seen = self._seen[scope] = self._seen.get(scope, 0) + 1
        if seen % int(str(settings["trace_rate"])) != 0:  # the rate-th, the 2*rate-th...: Triton's sampling
            return None
        remaining = self._remaining.get(scope, int(str(settings["trace_count"])))
        if remaining == 0:
            return None
        self._remaining[scope] = remaining - 1 if remaining > 0 else -1
        if self._file is not None:
            self._collection(scope, settings).created += 1
        return Trace(next(self._ids), model, version, request_id, scope, self._ids)

    def record(self, record: TraceRecord) -> None:
        """A finished trace (the front-end's moments included): to the trace file, or the log without one."""
        if self._file is None:
            trace_logger.info("trace %s", orjson.dumps(_log_record(record)).decode())
            return
        settings = self.settings(record.scope)
        self._collection(record.scope, settings).add(record, self._remaining.get(record.scope) == 0)

    def close(self) -> None:
        """Write every trace collected and end the file (blocks until it is written)."""
        for collection in self._collections.values():
            collection.flush()
        self._collections.clear()
        if self._file is not None:
            self._file.close()

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
            self.id, self.model_name, self.model_version, self.request_id, timestamps, self.scope, 0, children
        )
