"""The logging extension: levels and format, changeable while serving; the log file only at start."""

from __future__ import annotations

import logging
from dataclasses import fields, replace
from typing import Any

from geserve import log_records
from geserve.errors import InvalidArgumentError, UnsupportedError
from geserve.settings import LoggingSettings

LOG_FILE_REFUSAL = "log file location can not be updated through network protocol"
FORMATS = tuple(log_records.DATE_FORMATS)  # Triton's default and ISO8601, and json: one object per line
MAX_VERBOSE_LEVEL = 2**32 - 1


class LogControl:
    """The logging settings in force, and applying them: the server's LoggingSettings at start, then as the logging
    extension changes them."""

    def __init__(self, initial: LoggingSettings | None = None) -> None:
        self.current = initial or LoggingSettings()

    def as_json(self) -> dict[str, Any]:
        return {name: getattr(self.current, name) for name in _FIELDS}

    def update(self, changes: dict[str, Any]) -> None:
        """Apply changed settings (the logging extension); nothing changes when any value is bad."""
        if "log_file" in changes and changes["log_file"] != self.current.log_file:
            raise UnsupportedError(LOG_FILE_REFUSAL)
        for key, value in changes.items():
            if key in ("log_info", "log_warning", "log_error"):
                if not isinstance(value, bool):
                    raise InvalidArgumentError(f"expect boolean for '{key}'")
            elif key == "log_verbose_level":
                # Triton keeps it as a uint32 (LogSettingsRequest's uint32_param): a larger one could be
                # stored, then never reported over gRPC again.
                if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_VERBOSE_LEVEL:
                    raise InvalidArgumentError(f"expect unsigned integer for '{key}' (at most {MAX_VERBOSE_LEVEL})")
            elif key == "log_format":
                if value not in FORMATS:
                    raise InvalidArgumentError(f"invalid argument for log_format, got '{value}'")
            elif key != "log_file":
                raise InvalidArgumentError(f"log setting '{key}' is unknown")
        self.current = replace(self.current, **changes)
        self.apply()

    def apply(self) -> None:
        """Set the root logger's level and every handler's format (worker processes keep theirs)."""
        settings = self.current
        root = logging.getLogger()
        # With every level off, even critical messages are dropped.
        quiet = not (settings.log_verbose_level or settings.log_info or settings.log_warning or settings.log_error)
        root.setLevel(logging.CRITICAL + 10 if quiet else settings.level)
        formatter = log_records.formatter(settings.log_format)
        for handler in root.handlers:
            handler.setFormatter(formatter)


_FIELDS = tuple(field.name for field in fields(LoggingSettings))
