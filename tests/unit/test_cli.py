"""Command-line flags: tritonserver's names and defaults."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from geserve.cli import parse_options
from geserve.http.connections import ConnectionLimits
from tests.support import ROOT


def test_defaults_are_tritonservers() -> None:
    options = parse_options(["--model-repository=/models"])
    assert options.model_repositories == [Path("/models")]
    assert (options.http_port, options.grpc.port, options.metrics_port) == (8000, 8001, 8002)
    assert options.grpc.keepalive_time_ms == 7_200_000 and options.grpc.keepalive_timeout_ms == 20_000
    assert options.grpc.http2_max_pings_without_data == 2 and options.grpc.http2_max_ping_strikes == 2
    assert options.http_address == "0.0.0.0"
    assert options.http_max_input_size == 1 << 26
    assert options.http_limits == ConnectionLimits(header_timeout_s=30.0, body_timeout_s=60.0, keep_alive_s=5)
    assert options.strict_readiness and options.exit_on_error and options.auto_complete
    assert options.server_id == "triton"
    assert options.log_level == logging.INFO


def test_flags() -> None:
    options = parse_options(
        [
            "--model-store", "/a",
            "--model-repository=/b",
            "--http-port=9000",
            "--strict-readiness=false",
            "--exit-on-error", "false",
            "--log-verbose=1",
            "--http-max-input-size=1024",
            "--id=mine",
            "--strict-model-config=true",
            "--grpc-port=9001",
            "--grpc-keepalive-time=1000",
            "--grpc-keepalive-permit-without-calls=true",
            "--http-header-timeout-secs=2.5",
            "--http-body-timeout-secs=7",
            "--http-keepalive-timeout-secs=9",
            "--http-max-connections=100",
        ]
    )  # fmt: skip
    assert options.model_repositories == [Path("/a"), Path("/b")]
    assert options.http_port == 9000
    assert not options.strict_readiness and not options.exit_on_error
    assert options.log_level == logging.DEBUG
    assert options.http_max_input_size == 1024
    assert options.server_id == "mine"
    assert not options.auto_complete
    assert options.grpc.port == 9001 and options.grpc.keepalive_time_ms == 1000
    assert options.grpc.keepalive_permit_without_calls
    assert ("grpc.max_receive_message_length", 2**31 - 1) in options.grpc.channel_options()
    assert options.http_limits == ConnectionLimits(
        header_timeout_s=2.5, body_timeout_s=7.0, keep_alive_s=9, max_connections=100
    )
    assert not parse_options(["--model-repository=/a", "--disable-auto-complete-config"]).auto_complete
    assert parse_options(["--model-repository=/a", "--exit-on-error"]).exit_on_error


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--model-repository=/a", "--http-port=70000"],
        ["--model-repository=/a", "--strict-readiness=maybe"],
        ["--model-repository=/a", "--http-header-timeout-secs=0"],
        ["--model-repository=/a", "--http-body-timeout-secs=nan"],
        ["--model-repository=/a", "--http-max-connections=-1"],
    ],
)
def test_bad_flags_exit(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as error:
        parse_options(argv)
    assert error.value.code == 2


def test_help_documents_the_flags() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "geserve", "--help"], capture_output=True, text=True, check=True, cwd=ROOT
    )
    for flag in (
        "--model-repository",
        "--http-port",
        "--grpc-port",
        "--metrics-port",
        "--strict-readiness",
        "--exit-on-error",
        "--log-verbose",
        "--http-max-input-size",
        "--id",
    ):
        assert flag in result.stdout
