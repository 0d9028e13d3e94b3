"""The logging extension: levels and format, changeable while serving; the log file only at start."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from geserve.errors import InvalidArgumentError, UnsupportedError
from geserve.settings import LoggingSettings

LOG_FILE_REFUSAL = "log file location can not be updated through network protocol"
FORMATS = {
    "default": "%(asctime)s %(levelname)s %(name)s: %(message)s",
    "ISO8601": "%(asctime)s %(levelname)s %(name)s: %(message)s",
}
_DATE_FORMATS = {"default": None, "ISO8601": "%Y-%m-%dT%H:%M:%S%z"}


@dataclass(slots=True)
class LogSettings:
    """Triton's log_file, log_info, log_warning, log_error, log_verbose_level and log_format."""

    log_file: str = ""
    log_info: bool = True
    log_warning: bool = True
    log_error: bool = True
    log_verbose_level: int = 0
    log_format: str = "default"

    @classmethod
    def from_settings(cls, settings: LoggingSettings) -> LogSettings:
        return cls(**{name: getattr(settings, name) for name in cls.__dataclass_fields__})

    def as_json(self) -> dict[str, Any]:
        return {
            "log_file": self.log_file,
            "log_info": self.log_info,
            "log_warning": self.log_warning,
            "log_error": self.log_error,
            "log_verbose_level": self.log_verbose_level,
            "log_format": self.log_format,
        }

    @property
    def level(self) -> int:
        if self.log_verbose_level > 0:
            return logging.DEBUG
        if self.log_info:
            return logging.INFO
        if self.log_warning:
            return logging.WARNING
        if self.log_error:
            return logging.ERROR
        return logging.CRITICAL + 10

    def update(self, changes: dict[str, Any]) -> None:
        """Apply changed settings (the logging extension); nothing changes when any value is bad."""
        if "log_file" in changes and changes["log_file"] != self.log_file:
            raise UnsupportedError(LOG_FILE_REFUSAL)
        staged = LogSettings(**self.as_json())
        for key, value in changes.items():
            if key in ("log_info", "log_warning", "log_error"):
                if not isinstance(value, bool):
                    raise InvalidArgumentError(f"expect boolean for '{key}'")
                setattr(staged, key, value)
            elif key == "log_verbose_level":
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise InvalidArgumentError(f"expect unsigned integer for '{key}'")
                staged.log_verbose_level = value
            elif key == "log_format":
                if value not in FORMATS:
                    raise InvalidArgumentError(f"invalid argument for log_format, got '{value}'")
                staged.log_format = value
            elif key != "log_file":
                raise InvalidArgumentError(f"log setting '{key}' is unknown")
        for key, value in staged.as_json().items():
            setattr(self, key, value)
        self.apply()

    def apply(self) -> None:
        """Set the root logger's level and every handler's format (worker processes keep theirs)."""
        root = logging.getLogger()
        root.setLevel(self.level)
        formatter = logging.Formatter(FORMATS[self.log_format], _DATE_FORMATS[self.log_format])
        for handler in root.handlers:
            handler.setFormatter(formatter)
