"""GESERVE_<FLAG> variables: every flag from the environment, the command line winning, nothing ignored."""

from __future__ import annotations

from pathlib import Path

import pytest

from geserve import env_flags
from geserve.cli import parse_settings
from geserve.flags import build_parser

REPOSITORY = ["--model-repository=/models"]


def _refusal(capsys: pytest.CaptureFixture[str], argv: list[str], environ: dict[str, str]) -> str:
    with pytest.raises(SystemExit) as stopped:
        parse_settings(argv, environ=environ)
    assert stopped.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


def test_variables_set_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GESERVE_MODEL_REPOSITORY", "/from-env")
    monkeypatch.setenv("GESERVE_HTTP_PORT", "9000")
    monkeypatch.setenv("GESERVE_LOG_FORMAT", "json")
    monkeypatch.setenv("GESERVE_ID", "env-server")
    settings = parse_settings([])
    assert settings.repository.paths == (Path("/from-env"),)
    assert settings.http.port == 9000
    assert settings.server.logging.log_format == "json" and settings.workers.log_format == "json"
    assert settings.server.server_id == "env-server"


def test_the_command_line_wins() -> None:
    environ = {"GESERVE_HTTP_PORT": "9000", "GESERVE_ID": "env", "GESERVE_MODEL_REPOSITORY": '["/a", "/b"]'}
    settings = parse_settings(["--model-repository=/c", "--http-port=9100"], environ=environ)
    assert settings.http.port == 9100 and settings.server.server_id == "env"
    # A repeatable flag given on the command line takes the command line's values only, not the variable's too.
    assert settings.repository.paths == (Path("/c"),)
    # The alias counts as the same flag.
    assert parse_settings(["--model-store=/d"], environ=environ).repository.paths == (Path("/d"),)
    # An abbreviation argparse accepts is the flag too.
    assert parse_settings(["--http-po=9200", *REPOSITORY], environ=environ).http.port == 9200


def test_a_repeatable_flag_takes_one_value_or_a_json_list() -> None:
    environ = {
        "GESERVE_MODEL_CONTROL_MODE": "explicit",
        "GESERVE_LOAD_MODEL": '["simple", "digits"]',
        "GESERVE_TRACE_CONFIG": "triton,file=/tmp/trace.json",  # its comma is the value's, not a separator
        "GESERVE_METRICS_CONFIG": '["summary_latencies=true", "summary_quantiles=0.5:0.05,0.9:0.01"]',
    }
    settings = parse_settings(REPOSITORY, environ=environ)
    assert settings.repository.startup_models == ("simple", "digits")
    assert settings.server.trace == {"trace_file": "/tmp/trace.json"}
    assert settings.metrics.summary_latencies and settings.metrics.summary_quantiles == ((0.5, 0.05), (0.9, 0.01))
    one = parse_settings(REPOSITORY, environ={"GESERVE_MODEL_CONTROL_MODE": "explicit", "GESERVE_LOAD_MODEL": "a"})
    assert one.repository.startup_models == ("a",)


def test_booleans_take_what_the_flags_take() -> None:
    environ = {"GESERVE_STRICT_READINESS": "false", "GESERVE_ALLOW_GRPC": "0", "GESERVE_ALLOW_CLIENT_SHM": "yes"}
    settings = parse_settings(REPOSITORY, environ=environ)
    assert not settings.server.strict_readiness and not settings.grpc.enabled and settings.server.allow_client_shm
    # A flag that takes no value: given for true, left out for false.
    on = parse_settings(REPOSITORY, environ={"GESERVE_DISABLE_AUTO_COMPLETE_CONFIG": "true"})
    off = parse_settings(REPOSITORY, environ={"GESERVE_DISABLE_AUTO_COMPLETE_CONFIG": "false"})
    assert not on.workers.auto_complete and off.workers.auto_complete


@pytest.mark.parametrize(
    ("environ", "said"),
    [
        ({"GESERVE_HTTP_PROT": "9000"}, "GESERVE_HTTP_PROT names no geserve flag; did you mean GESERVE_HTTP_PORT?"),
        ({"GESERVE_FOO": "1"}, "environment variable GESERVE_FOO names no geserve flag"),
        ({"GESERVE_HELP": "1"}, "GESERVE_HELP: --help is not a setting"),
        ({"GESERVE_HTTP_PORT": "70000"}, "GESERVE_HTTP_PORT=70000: argument --http-port: port must be in [0, 65535]"),
        ({"GESERVE_HTTP_PORT": "abc"}, "GESERVE_HTTP_PORT=abc: argument --http-port: invalid"),
        ({"GESERVE_LOG_FORMAT": "xml"}, "GESERVE_LOG_FORMAT=xml: argument --log-format: invalid choice: 'xml'"),
        ({"GESERVE_STRICT_READINESS": "maybe"}, "GESERVE_STRICT_READINESS=maybe: argument --strict-readiness"),
        ({"GESERVE_DISABLE_AUTO_COMPLETE_CONFIG": "maybe"}, "GESERVE_DISABLE_AUTO_COMPLETE_CONFIG=maybe: expected"),
        ({"GESERVE_LOAD_MODEL": "[simple"}, "GESERVE_LOAD_MODEL: a value starting with '[' is a JSON list of strings"),
        ({"GESERVE_LOAD_MODEL": "[1, 2]"}, "GESERVE_LOAD_MODEL: a value starting with '[' is a JSON list of strings"),
        (
            {"GESERVE_MODEL_STORE": "/a", "GESERVE_MODEL_REPOSITORY": "/b"},
            "GESERVE_MODEL_REPOSITORY and GESERVE_MODEL_STORE both set",
        ),
    ],
)
def test_refused_variables_stop_the_start_naming_them(
    environ: dict[str, str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert said in _refusal(capsys, [], environ)


def test_a_refused_variable_is_refused_whatever_the_command_line_says(capsys: pytest.CaptureFixture[str]) -> None:
    # A variable the command line overrides is still checked: a typo in a deployment's environment is not hidden.
    assert "GESERVE_HTTP_PORT=abc" in _refusal(capsys, [*REPOSITORY, "--http-port=1"], {"GESERVE_HTTP_PORT": "abc"})
    assert "GESERVE_HTTP_PROT" in _refusal(capsys, [*REPOSITORY, "--http-port=1"], {"GESERVE_HTTP_PROT": "1"})


def test_the_test_suites_and_builds_variables_are_not_flags() -> None:
    environ = {
        "GESERVE_TEST_FRONTEND_PROCESSES": "2",
        "GESERVE_NPU_OM": "/x.om",
        "GESERVE_BENCH_CACHE": "/tmp",
        "GESERVE_VERSION": "0.1.0",  # the images' build argument
    }
    assert parse_settings(REPOSITORY, environ=environ).server.frontend_processes == 1
    # ... and no setting could ever be set by one of them.
    settable = [action for action in build_parser()._actions if action.dest not in ("help", "version")]
    variables = {env_flags.variable_of(option) for action in settable for option in action.option_strings}
    assert not [name for name in variables if name.startswith(env_flags.RESERVED_PREFIXES)]
    assert not variables & env_flags.RESERVED_NAMES


def test_tritonserver_flags_are_read_too(capsys: pytest.CaptureFixture[str]) -> None:
    """The tritonserver flags geserve refuses or ignores have their variables too, refused or warned about as on
    the command line."""
    refusal = _refusal(capsys, REPOSITORY, {"GESERVE_MODEL_NAMESPACING": "true"})
    assert "--model-namespacing=true is not supported" in refusal
    warned = parse_settings(REPOSITORY, environ={"GESERVE_BACKEND_DIRECTORY": "/opt/tritonserver/backends"})
    assert any("--backend-directory" in warning for warning in warned.server.warnings)
