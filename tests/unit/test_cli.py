"""Command-line flags: tritonserver's names and defaults."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from geserve.cli import parse_settings
from tests.support import ROOT


def test_defaults_are_tritonservers() -> None:
    options = parse_settings(["--model-repository=/models"])
    assert options.repository.paths == (Path("/models"),)
    assert (options.http.port, options.grpc.port, options.metrics.port) == (8000, 8001, 8002)
    assert options.grpc.keepalive_time_ms == 7_200_000 and options.grpc.keepalive_timeout_ms == 20_000
    assert options.grpc.http2_max_pings_without_data == 2 and options.grpc.http2_max_ping_strikes == 2
    assert options.http.address == "0.0.0.0"
    assert options.http.max_input_size == 1 << 26
    http = options.http
    assert (http.header_timeout_s, http.body_timeout_s, http.keep_alive_s, http.max_connections) == (30.0, 60.0, 5, 0)
    assert options.server.strict_readiness and options.server.exit_on_error and options.workers.auto_complete
    assert options.server.server_id == "triton"
    assert options.workers.log_level == logging.INFO


def test_flags() -> None:
    options = parse_settings(
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
    assert options.repository.paths == (Path("/a"), Path("/b"))
    assert options.http.port == 9000
    assert not options.server.strict_readiness and not options.server.exit_on_error
    assert options.workers.log_level == logging.DEBUG
    assert options.http.max_input_size == 1024
    assert options.server.server_id == "mine"
    assert not options.workers.auto_complete
    assert options.grpc.port == 9001 and options.grpc.keepalive_time_ms == 1000
    assert options.grpc.keepalive_permit_without_calls
    assert ("grpc.max_receive_message_length", 2**31 - 1) in options.grpc.channel_options()
    http = options.http
    assert (http.header_timeout_s, http.body_timeout_s, http.keep_alive_s, http.max_connections) == (2.5, 7.0, 9, 100)
    assert not parse_settings(["--model-repository=/a", "--disable-auto-complete-config"]).workers.auto_complete
    assert parse_settings(["--model-repository=/a", "--exit-on-error"]).server.exit_on_error


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
        parse_settings(argv)
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


def test_deployment_flags() -> None:
    options = parse_settings(
        [
            "--model-repository=/a",
            "--drain-delay-secs=10",
            "--reuse-http-port=true",
            "--reuse-grpc-port",
            "--grpc-max-connection-age=60000",
            "--grpc-max-connection-age-grace=5000",
        ]
    )
    assert options.server.drain_delay_secs == 10 and options.http.reuse_port and options.grpc.reuse_port
    channel_options = dict(options.grpc.channel_options())
    assert channel_options["grpc.so_reuseport"] == 1
    assert channel_options["grpc.max_connection_age_ms"] == 60000
    assert channel_options["grpc.max_connection_age_grace_ms"] == 5000
    defaults = parse_settings(["--model-repository=/a"])
    assert defaults.server.drain_delay_secs == 0 and not defaults.http.reuse_port
    default_channel = dict(defaults.grpc.channel_options())
    assert default_channel["grpc.so_reuseport"] == 0  # grpc's own default would share the port silently
    assert "grpc.max_connection_age_ms" not in default_channel


def test_tritonserver_tuning_flags_are_ignored_with_a_warning() -> None:
    options = parse_settings(
        [
            "--model-store=/a",
            "--backend-directory=/opt/tritonserver/backends",
            "--cuda-memory-pool-byte-size=0:0",
            "--pinned-memory-pool-byte-size", "0",
            "--http-thread-count=8",
            "--backend-config=tensorrt,coalesce-request-input=true",
            "--grpc-use-ssl=false",
            "--rate-limit=off",
        ]
    )  # fmt: skip
    assert options.server.warnings == (
        "ignoring --backend-directory: geserve's backends are built in",
        "ignoring --pinned-memory-pool-byte-size: geserve has no pinned memory pool; batches travel in each worker's "
        "shared-memory arenas (--worker-arena-size)",
        "ignoring --cuda-memory-pool-byte-size: geserve has no CUDA memory pool",
        "ignoring --http-thread-count: HTTP is served by one event loop",
        "ignoring --backend-config=tensorrt,coalesce-request-input=true: only tuning of Triton's own backends",
    )


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--allow-sagemaker=true", "--allow-sagemaker=true is not supported: geserve has no SageMaker endpoint"),
        ("--model-namespacing=true", "--model-namespacing=true is not supported"),
        ("--backend-config=default-max-batch-size=8", "--backend-config=default-max-batch-size=8 is not supported"),
    ],
)
def test_tritonserver_flags_that_would_change_behaviour_exit_2_naming_the_flag(
    flag: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as error:
        parse_settings(["--model-repository=/a", flag])
    assert error.value.code == 2
    assert message in capsys.readouterr().err


def test_client_shared_memory_caps() -> None:
    defaults = parse_settings(["--model-repository", "m"]).server
    assert (defaults.max_client_shm_regions, defaults.max_client_shm_bytes) == (4096, 64 << 30)
    chosen = parse_settings(
        ["--model-repository", "m", "--max-client-shm-regions=7", "--max-client-shm-bytes=1048576"]
    ).server
    assert (chosen.max_client_shm_regions, chosen.max_client_shm_bytes) == (7, 1048576)
    for flag in ("--max-client-shm-regions=0", "--max-client-shm-bytes=-1"):
        with pytest.raises(SystemExit):
            parse_settings(["--model-repository", "m", flag])


def test_grpc_caps_reach_the_channel_options() -> None:
    defaults = dict(parse_settings(["--model-repository", "m"]).grpc.channel_options())
    assert defaults["grpc.max_receive_message_length"] == 2**31 - 1  # Triton's fixed size
    assert defaults["grpc.max_concurrent_streams"] == 1024
    grpc = parse_settings(
        [
            "--model-repository",
            "m",
            "--grpc-max-message-size=1048576",
            "--grpc-max-concurrent-streams=8",
            "--grpc-max-inflight-rpcs=16",
            "--grpc-max-connections=32",
        ]
    ).grpc
    options = dict(grpc.channel_options())
    assert (options["grpc.max_receive_message_length"], options["grpc.max_concurrent_streams"]) == (1048576, 8)
    assert (grpc.max_inflight_rpcs, grpc.max_connections) == (16, 32)


def test_the_protocol_healthcheck_is_seconds_zero_or_more(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_settings(["--model-repository=/a"]).server.protocol_healthcheck_secs == 10
    settings = parse_settings(["--model-repository=/a", "--protocol-healthcheck-secs=2.5"])
    assert settings.server.protocol_healthcheck_secs == 2.5
    assert (
        parse_settings(["--model-repository=/a", "--protocol-healthcheck-secs=0"]).server.protocol_healthcheck_secs == 0
    )
    for value in ("-1", "soon", "inf", "nan"):
        with pytest.raises(SystemExit) as error:
            parse_settings(["--model-repository=/a", f"--protocol-healthcheck-secs={value}"])
        assert error.value.code == 2
        assert "--protocol-healthcheck-secs" in capsys.readouterr().err
