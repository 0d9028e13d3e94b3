"""ATC runs with the host's environment, not geserve's virtual environment, and its `python3` is checked."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from google.protobuf import text_format

from geserve._generated import model_config_pb2 as mc
from geserve.atc import compiler
from geserve.atc.python_env import atc_environment, check_atc_python
from geserve.cli import parse_settings
from tests.fakes import atc as fake_atc
from tests.fakes.om_models import affine_onnx

IN_A_VENV = sys.prefix != sys.base_prefix
AFFINE = """
name: "affine" backend: "ge" max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "s" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""


def test_the_virtual_environment_is_left_out_of_atcs_environment(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    environ = {
        "PATH": os.pathsep.join([str(venv / "bin"), "/usr/local/bin", "/usr/bin"]),
        "VIRTUAL_ENV": str(venv),
        "PYTHONPATH": "/usr/local/Ascend/cann/python/site-packages",
    }
    env = atc_environment(environ=environ, own_virtual_env=str(venv))
    assert env["PATH"] == os.pathsep.join(["/usr/local/bin", "/usr/bin"])
    assert "VIRTUAL_ENV" not in env
    assert env["PYTHONPATH"] == environ["PYTHONPATH"]  # CANN's own packages stay importable


def test_an_activated_venv_other_than_ours_is_left_out_too(tmp_path: Path) -> None:
    environ = {"PATH": f"{tmp_path / 'other' / 'bin'}{os.pathsep}/usr/bin", "VIRTUAL_ENV": str(tmp_path / "other")}
    assert atc_environment(environ=environ, own_virtual_env=str(tmp_path / "ours"))["PATH"] == "/usr/bin"


def test_a_named_interpreter_is_the_python3_first_on_atcs_path(tmp_path: Path) -> None:
    interpreter = tmp_path / "py39" / "bin" / "python3.9"
    interpreter.parent.mkdir(parents=True)
    interpreter.write_text("#!/bin/sh\n")
    interpreter.chmod(0o755)
    (interpreter.parent / "python3.9-config").write_text("#!/bin/sh\n")
    env = atc_environment(str(interpreter), environ={"PATH": "/usr/bin"})
    first = Path(env["PATH"].split(os.pathsep)[0])
    assert (first / "python3").resolve() == interpreter.resolve()
    assert (first / "python3-config").resolve() == interpreter.with_name("python3.9-config").resolve()
    assert env["PATH"].endswith(f"{os.pathsep}/usr/bin")


def _reporting_python3(folder: Path, report: dict[str, object]) -> dict[str, str]:
    """A PATH whose `python3` answers the probe with `report`, as an interpreter with those facts would."""
    folder.mkdir(parents=True)
    script = folder / "python3"
    script.write_text(f"#!/bin/sh\necho '{json.dumps(report)}'\n")
    script.chmod(0o755)
    return {"PATH": str(folder)}


def test_a_host_python_with_what_cann_needs_has_no_problem(tmp_path: Path) -> None:
    report = {
        "executable": "/usr/bin/python3",
        "prefix": "/usr",
        "version": [3, 11, 4],
        "missing": [],
        "numpy": "1.24.4",
    }
    checked = check_atc_python(_reporting_python3(tmp_path / "bin", report))
    assert checked.executable == "/usr/bin/python3" and checked.problems == ()


@pytest.mark.parametrize(("version", "refused"), [([3, 12, 1], True), ([3, 13, 0], False)])
def test_numpy_2_is_refused_before_python_3_13(tmp_path: Path, version: list[int], refused: bool) -> None:
    report = {"executable": "/usr/bin/python3", "prefix": "/usr", "version": version, "missing": [], "numpy": "2.1.0"}
    problems = check_atc_python(_reporting_python3(tmp_path / "bin", report)).problems
    assert bool(problems) == refused
    if refused:
        assert problems == (
            "ATC's python3 (/usr/bin/python3, Python 3.12.1) has numpy 2.1.0; CANN's operator compiler needs numpy "
            "< 2 before Python 3.13",
        )


def test_missing_packages_are_named(tmp_path: Path) -> None:
    report = {"executable": "/usr/bin/python3", "prefix": "/usr", "version": [3, 11, 4], "missing": ["decorator", "sympy"], "numpy": "1.24.4"}  # fmt: skip
    [problem] = check_atc_python(_reporting_python3(tmp_path / "bin", report)).problems
    assert "lacks decorator, sympy, which CANN's operator compiler imports" in problem and "--atc-python" in problem


def test_no_python3_on_atcs_path_is_a_problem(tmp_path: Path) -> None:
    assert check_atc_python({"PATH": str(tmp_path)}).problems == (
        "ATC finds no python3 on its PATH (CANN's operator compiler runs in it)",
    )


@pytest.mark.skipif(not IN_A_VENV, reason="the suite runs in a virtual environment where `make test` sets it up")
def test_geserves_own_interpreter_is_named_as_the_wrong_one(tmp_path: Path) -> None:
    """The probe itself, run in this virtual environment's python3: geserve's numpy 2 and none of CANN's packages."""
    problems = check_atc_python({"PATH": str(Path(sys.prefix) / "bin")}).problems
    assert any("is geserve's own virtual environment" in problem for problem in problems), problems
    assert any("lacks decorator" in problem for problem in problems), problems


def test_atc_python_names_an_interpreter_that_exists(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        parse_settings(["--model-repository", str(tmp_path), f"--atc-python={tmp_path / 'python3.9'}"])
    assert stopped.value.code == 2
    assert f"'{tmp_path / 'python3.9'}' is not an interpreter this server can run" in capsys.readouterr().err
    settings = parse_settings(["--model-repository", str(tmp_path), f"--atc-python={sys.executable}"])
    assert settings.workers.atc_python == str(Path(sys.executable).absolute())


@pytest.mark.skipif(not IN_A_VENV, reason="the suite runs in a virtual environment where `make test` sets it up")
def test_atc_started_from_inside_our_venv_finds_the_hosts_python3(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """geserve run from its activated venv: the stand-in atc, which looks for `python3` as ATC does, finds the host's
    interpreter, never the venv's, and no VIRTUAL_ENV."""
    host_bin = tmp_path / "host-bin"
    host_bin.mkdir()
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    (host_bin / "python3").symlink_to(base)
    atc = fake_atc.install(tmp_path / "atc-bin")
    venv_bin = Path(sys.prefix) / "bin"
    monkeypatch.setenv("PATH", os.pathsep.join([str(venv_bin), str(atc.parent), str(host_bin)]))
    monkeypatch.setenv("VIRTUAL_ENV", sys.prefix)
    monkeypatch.setenv("FAKE_ATC_PYTHON_LOG", str(tmp_path / "python.json"))
    folder = tmp_path / "models" / "affine"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.onnx").write_bytes(affine_onnx())
    config = text_format.Parse(AFFINE, mc.ModelConfig())
    compiler.compile_version(
        config, folder / "1" / "model.onnx", folder, compiler.Toolchain(str(atc), "Ascend310P3", "8.0", tmp_path / "c")
    )
    seen = json.loads((tmp_path / "python.json").read_text())
    assert seen["python3"] == str(host_bin / "python3"), seen
    assert seen["virtual_env"] is None and Path(seen["prefix"]).resolve() != Path(sys.prefix).resolve(), seen
