"""The flags whose row this file proves reach the setting they name: flag value -> Settings attribute."""

from __future__ import annotations

import pytest

from geserve.cli import parse_settings
from geserve.settings import Settings
from tests.parity.table import Row, rows_of

THIS_FILE = "tests/parity/test_flag_settings.py"
# flag: (value given, attribute path in Settings, the value it must hold)
SETTINGS = {
    "--exit-timeout-secs": ("7", "server.exit_timeout_secs", 7),
    "--worker-arena-size": ("1048576", "workers.arena_bytes", 1048576),
    "--worker-pipeline-depth": ("3", "workers.pipeline_depth", 3),
    "--allow-grpc": ("false", "grpc.enabled", False),
    "--grpc-address": ("127.0.0.2", "grpc.address", "127.0.0.2"),
    "--grpc-keepalive-timeout": ("1234", "grpc.keepalive_timeout_ms", 1234),
    "--grpc-http2-max-pings-without-data": ("5", "grpc.http2_max_pings_without_data", 5),
    "--grpc-http2-min-recv-ping-interval-without-data": (
        "4321",
        "grpc.http2_min_recv_ping_interval_without_data_ms",
        4321,
    ),
    "--grpc-http2-max-ping-strikes": ("6", "grpc.http2_max_ping_strikes", 6),
    "--allow-gpu-metrics": ("false", "metrics.gpu_metrics", False),
    "--allow-cpu-metrics": ("false", "metrics.cpu_metrics", False),
    "--metrics-address": ("127.0.0.3", "metrics.address", "127.0.0.3"),
    "--trace-config": ("level=TIMESTAMPS", "server.trace", {"trace_level": ["TIMESTAMPS"]}),
    "--log-info": ("false", "server.logging.log_info", False),
    "--log-warning": ("false", "server.logging.log_warning", False),
    "--log-error": ("false", "server.logging.log_error", False),
    "--log-format": ("ISO8601", "server.logging.log_format", "ISO8601"),
    "--log-file": ("/tmp/geserve-parity.log", "server.logging.log_file", "/tmp/geserve-parity.log"),
}


def _attribute(settings: Settings, path: str) -> object:
    value: object = settings
    for part in path.split("."):
        value = getattr(value, part)
    return value


@pytest.mark.parametrize("row", [row for row in rows_of("flag") if row.test_file == THIS_FILE], ids=lambda r: r.key)
def test_flag_reaches_its_setting(row: Row) -> None:
    assert row.key in SETTINGS, f"{row.where} names {THIS_FILE}, which has no case for {row.key}"
    value, path, expected = SETTINGS[row.key]
    default = _attribute(parse_settings(["--model-repository", "model_repository"]), path)
    assert default != expected, "the case must change the setting"
    assert (
        _attribute(parse_settings(["--model-repository", "model_repository", f"{row.key}={value}"]), path) == expected
    )
