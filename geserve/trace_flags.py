"""tritonserver's trace flags (`--trace-config [mode,]setting=value`, the deprecated `--trace-*`) -> trace settings."""

from __future__ import annotations

import argparse
from typing import Any

from geserve.core.trace import MODES, OTEL_KEYS
from geserve.errors import InvalidArgumentError

# --trace-config's settings by the name Triton's parser knows them: the global ones and the triton mode's.
_SETTINGS = {
    "level": "trace_level",
    "rate": "trace_rate",
    "count": "trace_count",
    "mode": "trace_mode",
    "file": "trace_file",
    "log-frequency": "log_frequency",
    "log_frequency": "log_frequency",
}
# Each mode's own settings: the triton mode's, and the opentelemetry mode's, OTEL_KEYS (those Triton's
# ProcessOpenTelemetryParameters reads, src/tracer.cc:499-536), named as /v2/trace/setting shows them; `resource`
# may be given again and again (one KEY=VALUE each). The other mode's are ignored with a warning, where Triton
# ignores them without one.
_MODE_SETTINGS = {"triton": ("trace_file", "log_frequency"), "opentelemetry": OTEL_KEYS}
# The deprecated flags Triton still accepts (with a warning), and the --trace-config that replaces each.
DEPRECATED = {
    "trace_file": ("--trace-file", "--trace-config triton,file=<filepath>"),
    "trace_level": ("--trace-level", "--trace-config level=<OFF|TIMESTAMPS|TENSORS>"),
    "trace_rate": ("--trace-rate", "--trace-config rate=<rate value>"),
    "trace_count": ("--trace-count", "--trace-config count=<count value>"),
    "log_frequency": ("--trace-log-frequency", "--trace-config triton,log-frequency=<log frequency value>"),
}
# Triton's spellings of the levels (ParseTraceLevelOption).
_LEVELS = {
    "off": "OFF",
    "false": "OFF",
    "timestamps": "TIMESTAMPS",
    "true": "TIMESTAMPS",
    "on": "TIMESTAMPS",
    "min": "TIMESTAMPS",
    "max": "TIMESTAMPS",
    "tensors": "TENSORS",
}


def add_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--trace-config",
        action="append",
        default=[],
        metavar="[MODE,]SETTING=VALUE",
        help="level=OFF|TIMESTAMPS, rate=N, count=N, mode=triton|opentelemetry; triton,file=PATH (Triton's trace "
        "file; without one, traces go to the log), triton,log-frequency=N (every N traces to PATH.<n>); "
        "opentelemetry,url=HOST:PORT/PATH (OTLP/HTTP), opentelemetry,resource=KEY=VALUE, "
        "opentelemetry,bsp_max_queue_size|bsp_schedule_delay|bsp_max_export_batch_size=N; repeatable",
    )
    for key, (flag, replacement) in DEPRECATED.items():
        group.add_argument(
            flag,
            dest=f"deprecated_{key}",
            action="append" if key == "trace_level" else "store",
            default=None,
            metavar="VALUE",
            help=f"deprecated: use {replacement}",
        )


def _level(value: str) -> str:
    level = _LEVELS.get(value.lower())
    if level is None:
        raise InvalidArgumentError(f"invalid value for trace level option: {value}")
    return level


def _parse_entry(entry: str) -> tuple[str, str]:
    """One --trace-config as (setting's name, value), Triton's format errors and mode handling."""
    mode, comma, rest = entry.partition(",")
    if not comma:
        mode, rest = "", entry
    elif not mode:
        raise InvalidArgumentError(
            "No trace mode specified. --trace-config option format is <trace mode>,<setting>=<value> or "
            f"<setting>=<value>. Got {entry}"
        )
    elif mode.lower() not in MODES:
        raise InvalidArgumentError(
            f'invalid value for trace mode option: {mode}. Available options are "triton" and "opentelemetry"'
        )
    # Split at the first '=' only: a resource's value is itself KEY=VALUE.
    key, equals, value = rest.partition("=")
    if not equals or not key or not value:
        raise InvalidArgumentError(f"--trace-config option format is '<trace mode>,<setting>=<value>'. Got {entry}")
    if mode.lower() == "opentelemetry":
        if key not in OTEL_KEYS:
            raise InvalidArgumentError(
                f"--trace-config {entry}: unknown opentelemetry trace setting '{key}'; known: {', '.join(OTEL_KEYS)}"
            )
        return key, value
    if key not in _SETTINGS:
        known = ", ".join(name for name in _SETTINGS if name != "log_frequency")
        raise InvalidArgumentError(f"--trace-config {entry}: unknown trace setting '{key}'; known: {known}")
    return _SETTINGS[key], value


def trace_settings(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """The startup trace settings (TraceController's names) and Triton's warnings for deprecated flags.
    A --trace-config setting wins over the deprecated flag for it; OFF among the levels turns tracing off."""
    settings: dict[str, Any] = {}
    warnings = []
    given: set[str] = set()
    for key, (flag, replacement) in DEPRECATED.items():
        value = getattr(args, f"deprecated_{key}", None)
        if value is None:
            continue
        warnings.append(
            f"'{flag}' has been deprecated and will be removed in future releases. Please use '{replacement}' instead."
        )
        given.add(key)
        settings[key] = [_level(level) for level in value] if key == "trace_level" else value
    configured: dict[str, Any] = {}
    for entry in args.trace_config:
        key, value = _parse_entry(entry)
        if key in ("trace_level", "resource"):
            configured.setdefault(key, []).append(_level(value) if key == "trace_level" else value)
        else:
            configured[key] = value.lower() if key == "trace_mode" else value
    for key in configured:
        if key in given:
            warnings.append(f"Overriding deprecated '{DEPRECATED[key][0]}' in favor of --trace-config {key}")
    settings.update(configured)
    if "OFF" in settings.get("trace_level", []):
        settings["trace_level"] = ["OFF"]  # an explicit OFF disables tracing, as Triton's
    mode = settings.get("trace_mode", "triton")
    for other, keys in _MODE_SETTINGS.items():
        for key in keys if other != mode else ():
            if key in settings:
                del settings[key]
                warnings.append(_ignored(key, other, mode, key in given and key not in configured))
    return settings, warnings


def _ignored(key: str, other: str, mode: str, deprecated: bool) -> str:
    """The warning for a setting of the mode not in use (Triton's words for its deprecated flags)."""
    if deprecated:
        return f"'{DEPRECATED[key][0]}' is deprecated and will be ignored with {mode} tracing mode."
    name = {"trace_file": "file", "log_frequency": "log-frequency"}.get(key, key)
    return f"--trace-config {other},{name}=... is ignored with {mode} tracing mode."
