"""The installed console scripts as a user first meets them: `--help` names the offline commands, `--version`
answers, and the `tritonserver` name says `tritonserver`."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from geserve.cli import main
from tests.support import ROOT

BIN = Path(sys.executable).parent
COMMANDS = ("inspect", "check", "compile")


def _run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    path = BIN / script
    assert path.is_file(), f"{path} is not installed: pip install -e . makes it"
    return subprocess.run([str(path), *args], capture_output=True, text=True, cwd=ROOT, timeout=60, check=False)


def test_help_lists_each_offline_command() -> None:
    result = _run("geserve", "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: geserve "), result.stdout[:200]
    for command in COMMANDS:
        assert f"\n  geserve {command} " in result.stdout, result.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_each_listed_command_runs(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as raised:
        main([command, "--help"])
    assert raised.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: geserve {command} ")


def test_version_prints_the_installed_version() -> None:
    for args in (("--version",), ("--model-repository", "model_repository", "--version")):
        result = _run("geserve", *args)
        assert result.returncode == 0, result.stderr
        assert result.stdout == f"geserve {metadata.version('geserve')}\n"


def test_tritonserver_says_tritonserver() -> None:
    result = _run("tritonserver", "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: tritonserver "), result.stdout[:200]
    assert "\n  tritonserver check " in result.stdout, result.stdout
    refused = _run("tritonserver")
    assert refused.returncode == 2
    assert refused.stderr.splitlines()[-1].startswith("tritonserver: error: "), refused.stderr
    assert "geserve" not in refused.stderr, refused.stderr


def test_a_tritonserver_first_word_says_tritonserver(capsys: pytest.CaptureFixture[str]) -> None:
    # Triton's runtimes start the image as `tritonserver --model-repository=...` after its entry point.
    with pytest.raises(SystemExit) as raised:
        main(["tritonserver", "--help"])
    assert raised.value.code == 0
    assert capsys.readouterr().out.startswith("usage: tritonserver ")


def test_tritonserver_offline_commands_say_tritonserver(tmp_path: Path) -> None:
    helped = _run("tritonserver", "check", "--help")
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.startswith("usage: tritonserver check "), helped.stdout[:200]
    refused = _run("tritonserver", "inspect", str(tmp_path / "missing.om"))
    assert refused.returncode == 1
    assert refused.stderr.startswith(f"tritonserver inspect: '{tmp_path / 'missing.om'}' cannot be read"), (
        refused.stderr
    )


@pytest.mark.parametrize("command", COMMANDS)
def test_each_offline_command_after_a_tritonserver_first_word_says_tritonserver(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as raised:
        main(["tritonserver", command, "--help"])
    assert raised.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: tritonserver {command} ")
