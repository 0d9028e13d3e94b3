"""Log lines: the JSON formatter's fields, the text formats, and --log-format=json through the logging extension."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from geserve import log_records
from geserve.core.log_control import FORMATS, LogControl
from geserve.errors import InvalidArgumentError
from geserve.settings import LoggingSettings


def _record(message: str = "model '%s' is %s", *args: object, **extra: object) -> logging.LogRecord:
    record = logging.LogRecord("geserve.core.repository", logging.WARNING, __file__, 1, message, args or None, None)
    record.__dict__.update(extra)
    return record


def _json(line: str) -> dict[str, object]:
    assert "\n" not in line
    parsed = json.loads(line)
    assert isinstance(parsed, dict)
    return parsed


def test_a_json_line_has_time_level_logger_message_and_pid() -> None:
    line = _json(log_records.JsonFormatter().format(_record("model '%s' is %s", "echo", "ready")))
    assert line["level"] == "WARNING" and line["logger"] == "geserve.core.repository"
    assert line["message"] == "model 'echo' is ready"
    assert isinstance(line["pid"], int)
    time = datetime.fromisoformat(str(line["time"]))
    assert time.tzinfo is not None and time.utcoffset() is not None
    assert str(line["time"]).endswith("+00:00") and "." in str(line["time"])
    assert not {"model", "version", "request_id"} & line.keys()


def test_a_request_line_carries_model_version_and_request_id() -> None:
    fields = log_records.request_fields("echo", 1, "req-7")
    assert fields == {"model": "echo", "version": "1", "request_id": "req-7"}
    line = _json(log_records.JsonFormatter().format(_record("failed", **fields)))
    assert (line["model"], line["version"], line["request_id"]) == ("echo", "1", "req-7")
    # What is not known is left out, not written empty.
    assert log_records.request_fields("echo") == {"model": "echo"}
    assert "version" not in _json(log_records.JsonFormatter().format(_record("x", **log_records.request_fields("e"))))


def test_a_traceback_stays_in_the_line() -> None:
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        record = logging.LogRecord("geserve.x", logging.ERROR, __file__, 1, "failed:\n%s", ("two",), sys.exc_info())
    line = _json(log_records.JsonFormatter().format(record))
    assert line["message"] == "failed:\ntwo"
    assert "Traceback (most recent call last)" in str(line["exc_info"]) and "ValueError: boom" in str(line["exc_info"])


def test_worker_tags_are_fields_but_never_replace_the_lines_own() -> None:
    tags: dict[str, str | int] = {"model": "talker", "version": "1", "instance": "talker_0", "device": 0, "pid": 1}
    record = _record("x")
    record.process = 4242
    line = _json(log_records.formatter("json", tags).format(record))
    assert (line["model"], line["version"], line["instance"], line["device"]) == ("talker", "1", "talker_0", 0)
    assert line["pid"] == 4242  # the record's own, not the tag


def test_without_orjson_the_line_is_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    record = _record("snowman \u2603 %s", "\u00e9", **log_records.request_fields("m", 2, "r"))
    with_orjson = _json(log_records.JsonFormatter().format(record))
    monkeypatch.setattr(log_records, "orjson", None)  # a python model's execution environment
    assert _json(log_records.JsonFormatter().format(record)) == with_orjson


def test_text_formats_are_tritons_and_the_worker_tag_starts_the_message() -> None:
    """Triton's layouts (common logging.cc): glog's for default, ISO 8601's, both in UTC, with pid and file:line."""
    record = _record("x")
    record.created = 1796505958.874  # 2026-12-05 21:25:58.874 UTC
    record.process, record.filename, record.lineno = 1234, "repository.py", 77
    default = log_records.formatter("default").format(record)
    assert default == "W1205 21:25:58.874000 1234 repository.py:77] x", default
    iso = log_records.formatter("ISO8601").format(record)
    assert iso == "2026-12-05T21:25:58Z W 1234 repository.py:77] x", iso
    tags: dict[str, str | int] = {"model": "m", "version": "1", "instance": "m_0", "device": 0, "pid": 9}
    worker = log_records.formatter("ISO8601", tags, label="worker").format(record)
    assert worker.endswith(" W 1234 repository.py:77] [worker model=m version=1 instance=m_0 device=0 pid=9] x")
    for level, letter in ((logging.DEBUG, "I"), (logging.INFO, "I"), (logging.ERROR, "E"), (logging.CRITICAL, "E")):
        record.levelno = level
        assert log_records.formatter("default").format(record).startswith(letter + "1205 "), level


@pytest.fixture
def root_handler() -> Iterator[logging.Handler]:
    """A handler of the root logger's own for the test, its level and handlers restored after."""
    root = logging.getLogger()
    level, handlers = root.level, root.handlers[:]
    handler = logging.NullHandler()
    root.handlers = [handler]
    yield handler
    root.handlers = handlers
    root.setLevel(level)


def test_the_logging_extension_takes_json(root_handler: logging.Handler) -> None:
    assert "json" in FORMATS
    control = LogControl(LoggingSettings())
    control.update({"log_format": "json"})
    assert control.as_json()["log_format"] == "json"
    assert isinstance(root_handler.formatter, log_records.JsonFormatter)
    control.update({"log_format": "ISO8601"})
    assert not isinstance(root_handler.formatter, log_records.JsonFormatter)
    with pytest.raises(InvalidArgumentError, match="invalid argument for log_format, got 'xml'"):
        control.update({"log_format": "xml"})


def test_log_to_appends_json_lines_to_the_log_file(tmp_path: Path) -> None:
    root = logging.getLogger()
    level, handlers = root.level, root.handlers[:]
    log_file = tmp_path / "geserve.log"
    log_file.write_text("an earlier line\n")
    root.handlers = []
    try:
        log_records.log_to(str(log_file), logging.INFO, "json", {"model": "m"})
        logging.getLogger("geserve.test").info("hello %s", "file", extra=log_records.request_fields("m", 1, "r"))
        logging.getLogger("geserve.test").debug("below the level")
        for handler in root.handlers:
            handler.close()
    finally:
        root.handlers = handlers
        root.setLevel(level)
    first, second, *rest = log_file.read_text().splitlines()
    assert first == "an earlier line" and not rest
    line = _json(second)
    assert (line["message"], line["model"], line["version"], line["request_id"]) == ("hello file", "m", "1", "r")
