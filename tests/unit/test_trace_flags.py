"""tritonserver's trace flags: --trace-config's modes and settings, and the deprecated --trace-* flags."""

from __future__ import annotations

import sys

import pytest

from geserve.cli import parse_settings
from geserve.core.trace import TraceController


def _trace(*flags: str) -> tuple[dict[str, object], tuple[str, ...]]:
    settings = parse_settings(["--model-repository=/models", *flags])
    return dict(settings.server.trace), settings.server.warnings


def test_trace_config_settings_global_and_of_the_triton_mode() -> None:
    trace, warnings = _trace(
        "--trace-config=triton,file=/tmp/trace.json",
        "--trace-config=triton,log-frequency=50",
        "--trace-config=rate=100",
        "--trace-config=level=TIMESTAMPS",
        "--trace-config=count=100",
        "--trace-config=mode=triton",
    )
    assert trace == {
        "trace_file": "/tmp/trace.json",
        "log_frequency": "50",
        "trace_rate": "100",
        "trace_level": ["TIMESTAMPS"],
        "trace_count": "100",
        "trace_mode": "triton",
    }
    assert not [warning for warning in warnings if "trace" in warning]


def test_tritons_level_spellings_and_an_explicit_off_wins() -> None:
    assert _trace("--trace-config=level=max")[0]["trace_level"] == ["TIMESTAMPS"]
    assert _trace("--trace-config=level=timestamps", "--trace-config=level=off")[0]["trace_level"] == ["OFF"]


def test_deprecated_flags_map_to_trace_config_with_tritons_warning() -> None:
    trace, warnings = _trace(
        "--trace-file=/tmp/old.json",
        "--trace-level=TIMESTAMPS",
        "--trace-rate=5",
        "--trace-count=3",
        "--trace-log-frequency=2",
    )
    assert trace == {
        "trace_file": "/tmp/old.json",
        "trace_level": ["TIMESTAMPS"],
        "trace_rate": "5",
        "trace_count": "3",
        "log_frequency": "2",
    }
    assert (
        "'--trace-file' has been deprecated and will be removed in future releases. "
        "Please use '--trace-config triton,file=<filepath>' instead."
    ) in warnings
    assert sum("has been deprecated" in warning for warning in warnings) == 5


def test_trace_config_overrides_the_deprecated_flag_and_says_so() -> None:
    trace, warnings = _trace("--trace-rate=5", "--trace-config=rate=7")
    assert trace["trace_rate"] == "7"
    assert any(warning.startswith("Overriding deprecated '--trace-rate'") for warning in warnings)


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--trace-config=mode=jaeger", 'invalid value for trace mode option: jaeger. Available options are "triton"'),
        ("--trace-config=opentelemetry,file=x", "unknown opentelemetry trace setting 'file'; known: url, resource"),
        ("--trace-config=jaeger,file=x", 'invalid value for trace mode option: jaeger. Available options are "triton"'),
        ("--trace-config=,file=x", "No trace mode specified."),
        ("--trace-config=triton,file", "--trace-config option format is '<trace mode>,<setting>=<value>'."),
        ("--trace-config=colour=red", "unknown trace setting 'colour'"),
        ("--trace-config=level=TENSORS", "trace level TENSORS is not supported by geserve"),
        ("--trace-level=loud", "invalid value for trace level option: loud"),
        ("--trace-rate=0", "invalid value 0 for 'trace_rate'"),
        ("--trace-log-frequency=often", "unable to parse 'log_frequency', got: often"),
    ],
)
def test_bad_trace_flags_are_refused_naming_the_problem(
    flag: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_settings(["--model-repository=/models", flag])
    error = capsys.readouterr().err
    assert message in error and "unrecognized arguments" not in error
    assert _trace("--trace-config=rate=3")[0]["trace_rate"] == "3"  # a good one still parses


OTEL = ("--trace-config=mode=opentelemetry", "--trace-config=level=TIMESTAMPS")


def test_opentelemetry_mode_and_its_settings_as_triton_names_them() -> None:
    trace, warnings = _trace(
        *OTEL,
        "--trace-config=opentelemetry,url=collector:4318/v1/traces",
        "--trace-config=opentelemetry,resource=service.name=triton",
        "--trace-config=opentelemetry,resource=service.version=1",
        "--trace-config=opentelemetry,bsp_max_queue_size=100",
        "--trace-config=opentelemetry,bsp_schedule_delay=50",
        "--trace-config=opentelemetry,bsp_max_export_batch_size=10",
        "--trace-config=rate=0",  # Triton's way to trace only the requests that carry a client's context
    )
    assert trace == {
        "trace_mode": "opentelemetry",
        "trace_level": ["TIMESTAMPS"],
        "trace_rate": "0",
        "url": "collector:4318/v1/traces",
        "resource": ["service.name=triton", "service.version=1"],
        "bsp_max_queue_size": "100",
        "bsp_schedule_delay": "50",
        "bsp_max_export_batch_size": "10",
    }
    assert not [warning for warning in warnings if "trace" in warning]


def test_the_other_modes_settings_are_ignored_saying_so() -> None:
    trace, warnings = _trace(*OTEL, "--trace-config=triton,file=/tmp/t.json", "--trace-log-frequency=2")
    assert "trace_file" not in trace and "log_frequency" not in trace
    assert "--trace-config triton,file=... is ignored with opentelemetry tracing mode." in warnings
    assert "'--trace-log-frequency' is deprecated and will be ignored with opentelemetry tracing mode." in warnings
    trace, warnings = _trace("--trace-config=opentelemetry,url=collector:4318")
    assert "url" not in trace
    assert "--trace-config opentelemetry,url=... is ignored with triton tracing mode." in warnings


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--trace-config=opentelemetry,bsp_max_queue_size=0",), "invalid value 0 for 'bsp_max_queue_size'"),
        (("--trace-config=opentelemetry,bsp_schedule_delay=soon",), "unable to parse 'bsp_schedule_delay', got: soon"),
        (
            ("--trace-config=opentelemetry,bsp_max_queue_size=100",),
            "bsp_max_export_batch_size (512) must be less than or equal to bsp_max_queue_size (100)",
        ),
        (("--trace-config=opentelemetry,resource=service.name",), "invalid trace resource 'service.name'"),
        (("--trace-config=opentelemetry,colour=red",), "unknown opentelemetry trace setting 'colour'"),
    ],
)
def test_bad_opentelemetry_settings_are_refused(
    flags: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_settings(["--model-repository=/models", *OTEL, *flags])
    assert message in capsys.readouterr().err


def test_the_batch_span_processors_variables_are_its_defaults(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "250")
    assert TraceController(_trace(*OTEL)[0]).settings()["bsp_schedule_delay"] == "250"
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "many")
    with pytest.raises(SystemExit):
        parse_settings(["--model-repository=/models", *OTEL])
    assert "OTEL_BSP_MAX_QUEUE_SIZE: unable to parse 'bsp_max_queue_size', got: many" in capsys.readouterr().err
    # Given on the command line, the variable is not read.
    assert _trace(*OTEL, "--trace-config=opentelemetry,bsp_max_queue_size=4096")[0]["bsp_max_queue_size"] == "4096"


def test_without_the_otel_extra_the_mode_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # As if the SDK were not installed: an import of it fails.
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk", None)
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    with pytest.raises(SystemExit):
        parse_settings(["--model-repository=/models", *OTEL])
    error = capsys.readouterr().err
    assert "trace mode opentelemetry needs the OpenTelemetry SDK" in error
    assert "pip install 'geserve[otel]'" in error
