"""The trace extension: global and per-model settings, sampling, and TIMESTAMPS traces to the log."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from geserve.errors import InvalidArgumentError, UnsupportedError

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
    """Settings as Triton keeps them (per model, falling back to the global ones), and which requests
    to trace: every `trace_rate`-th request of a model, `trace_count` times (-1: no limit)."""

    def __init__(self, initial: Mapping[str, Any] | None = None) -> None:
        self._global = _Settings(_defaults())
        self._models: dict[str, _Settings] = {}
        self._seen: dict[str, int] = {}
        self._remaining: dict[str, int] = {}
        self._ids = itertools.count(1)
        self.active = False  # any level other than OFF anywhere: lets untraced requests skip all of this
        if initial:
            self.update(None, dict(initial), from_network=False)

    def settings(self, model: str | None = None) -> dict[str, list[str] | str]:
        merged = dict(self._global.values)
        if model is not None and model in self._models:
            merged.update(self._models[model].values)
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
        # New settings restart sampling, as a new trace_count means "this many more".
        for name in [model] if model is not None else list(self._remaining):
            self._remaining.pop(name, None)
            self._seen.pop(name, None)
        return self.settings(model)

    def start(self, model: str, version: str, request_id: str) -> Trace | None:
        """A trace for this request, or None when it is not sampled."""
        if not self.active:
            return None
        settings = self.settings(model)
        if settings["trace_level"] == ["OFF"]:
            return None
        seen = self._seen[model] = self._seen.get(model, 0) + 1
        if (seen - 1) % int(str(settings["trace_rate"])) != 0:
            return None
        remaining = self._remaining.get(model, int(str(settings["trace_count"])))
        if remaining == 0:
            return None
        self._remaining[model] = remaining - 1 if remaining > 0 else -1
        return Trace(next(self._ids), model, version, request_id)


@dataclass(slots=True)
class Trace:
    """One traced request's timestamps (time.monotonic_ns, as the scheduler and workers take them)."""

    id: int
    model_name: str
    model_version: str
    request_id: str
    timestamps: list[tuple[str, int]] = field(default_factory=list)

    def mark(self, name: str, ns: int) -> None:
        self.timestamps.append((name, ns))

    def add(self, marks: Sequence[tuple[str, int]]) -> None:
        self.timestamps.extend(marks)

    def emit(self) -> None:
        record = {
            "id": self.id,
            "model_name": self.model_name,
            "model_version": self.model_version,
            "request_id": self.request_id,
            "timestamps": [{"name": name, "ns": ns} for name, ns in self.timestamps],
        }
        trace_logger.info("trace %s", orjson.dumps(record).decode())
