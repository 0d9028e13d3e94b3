"""tritonserver's trace flags: --trace-config's modes and settings, and the deprecated --trace-* flags."""

from __future__ import annotations

import pytest

from geserve.cli import parse_settings


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
        ("--trace-config=opentelemetry,url=localhost:4318", "trace mode 'opentelemetry' is not supported by geserve"),
        ("--trace-config=mode=opentelemetry", "trace mode 'opentelemetry' is not supported by geserve"),
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
