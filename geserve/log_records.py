"""How every geserve process writes its log lines: Triton's text formats, or one JSON object per line."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

try:
    import orjson
except ImportError:  # a python model's execution environment holds geserve's own package, not its dependencies
    orjson = None  # type: ignore[assignment]

# --log-format's values (and the logging extension's log_format): Triton's two text layouts, and one JSON object
# per line.
DATE_FORMATS: dict[str, str | None] = {"default": "%m%d %H:%M:%S", "ISO8601": "%Y-%m-%dT%H:%M:%SZ", "json": None}
JSON = "json"
ISO8601 = "ISO8601"
# Triton's level letters (common logging.h LEVEL_NAMES); its verbose lines are "I" too.
_LETTERS = {logging.DEBUG: "I", logging.INFO: "I", logging.WARNING: "W", logging.ERROR: "E", logging.CRITICAL: "E"}
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


class TritonFormatter(logging.Formatter):
    """Triton's text lines (common logging.cc LogPreamble), in UTC: `default` is glog's
    `I1205 21:25:58.874000 <pid> <file>:<line>] <message>`, `ISO8601` is
    `2026-12-05T21:29:43Z I <pid> <file>:<line>] <message>`; a worker's `[label name=value ...]` starts its message."""

    def __init__(self, log_format: str, prefix: str = "") -> None:
        super().__init__()
        self._iso8601 = log_format == ISO8601
        self._date = DATE_FORMATS[log_format] or ""
        self._prefix = prefix

    def format(self, record: logging.LogRecord) -> str:
        when = time.gmtime(record.created)
        letter = _LETTERS.get(record.levelno, "E" if record.levelno > logging.WARNING else "I")
        where = f"{record.process} {record.filename}:{record.lineno}] "
        if self._iso8601:
            head = f"{time.strftime(self._date, when)} {letter} {where}"
        else:
            micros = int((record.created % 1) * 1_000_000)
            head = f"{letter}{time.strftime(self._date, when)}.{micros:06d} {where}"
        record.message = record.getMessage()  # as logging.Formatter leaves it, for whoever reads the record after
        line = head + self._prefix + record.message
        if record.exc_info:
            line += "\n" + (record.exc_text or self.formatException(record.exc_info))
        if record.stack_info:
            line += "\n" + self.formatStack(record.stack_info)
        return line


def formatter(log_format: str, tags: Mapping[str, str | int] | None = None, label: str = "") -> logging.Formatter:
    """The formatter of `log_format`: a text line starts its message with `[label name=value ...]` of `tags`, a JSON
    line has them as fields."""
    if log_format == JSON:
        return JsonFormatter(tags)
    tagged = " ".join([label, *(f"{name}={value}" for name, value in (tags or {}).items())]).strip()
    return TritonFormatter(log_format, f"[{tagged}] " if tagged else "")


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
