"""How every geserve process writes its log lines: Triton's text formats, or one JSON object per line."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

try:
    import orjson
except ImportError:  # a python model's execution environment holds geserve's own package, not its dependencies
    orjson = None  # type: ignore[assignment]

TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# --log-format's values (and the logging extension's log_format) -> the date format of a text line; json: none.
DATE_FORMATS: dict[str, str | None] = {"default": None, "ISO8601": "%Y-%m-%dT%H:%M:%S%z", "json": None}
JSON = "json"
# What a line about one request says of it, each when known: log calls pass them with `extra=request_fields(...)`.
REQUEST_FIELDS = ("model", "version", "request_id")
# The fields every JSON line starts with: a worker's tags never replace them.
_BASE_FIELDS = frozenset({"time", "level", "logger", "message", "pid", "exc_info", "stack_info"})


def request_fields(model: str, version: str | int = "", request_id: str = "") -> dict[str, str]:
    """The `extra=` of a log call about a request (or a model): the fields that are known, as strings."""
    fields = {"model": model, "version": str(version), "request_id": request_id}
    return {name: value for name, value in fields.items() if value}


def _encoder() -> Callable[[dict[str, Any]], str]:
    if orjson is not None:
        return lambda line: orjson.dumps(line, default=str).decode()
    return lambda line: json.dumps(line, default=str, ensure_ascii=False)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (ISO 8601, UTC), level, logger, message, pid, the request's fields where the log
    call gave them, `tags` (a worker's model, version, instance and device), and a traceback as `exc_info`."""

    def __init__(self, tags: Mapping[str, str | int] | None = None) -> None:
        super().__init__()
        self._tags = {name: value for name, value in (tags or {}).items() if name not in _BASE_FIELDS}
        self._encode = _encoder()

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="microseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
            **self._tags,
        }
        for name in REQUEST_FIELDS:
            value = record.__dict__.get(name)
            if value not in (None, ""):
                line[name] = str(value)
        if record.exc_info:
            line["exc_info"] = record.exc_text or self.formatException(record.exc_info)
        if record.stack_info:
            line["stack_info"] = self.formatStack(record.stack_info)
        return self._encode(line)


def formatter(log_format: str, tags: Mapping[str, str | int] | None = None, label: str = "") -> logging.Formatter:
    """The formatter of `log_format`: a text line shows `[label name=value ...]` of `tags` before the logger's name, a
    JSON line has them as fields."""
    if log_format == JSON:
        return JsonFormatter(tags)
    tagged = " ".join([label, *(f"{name}={value}" for name, value in (tags or {}).items())]).strip()
    text = TEXT.replace("%(name)s", f"[{tagged}] %(name)s") if tagged else TEXT
    return logging.Formatter(text, DATE_FORMATS[log_format])


def log_to(
    log_file: str, level: int, log_format: str, tags: Mapping[str, str | int] | None = None, label: str = ""
) -> None:
    """The root logger's level, and its one handler unless it has one already (a test's log capture): standard
    error, or `log_file`, opened to append: every process of a server writes its lines at the file's end, none over
    another's."""
    root = logging.getLogger()
    root.setLevel(level)
    if root.handlers:
        return
    handler: logging.Handler = logging.FileHandler(log_file) if log_file else logging.StreamHandler()
    handler.setFormatter(formatter(log_format, tags, label))
    root.addHandler(handler)
