"""`geserve check` on ensembles: the shipped repository passes, and each broken ensemble is named with its reason."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from geserve.cli import main
from tests.fakes.om_models import affine_onnx
from tests.support import MODEL_REPOSITORY, ROOT, copy_model, write_identity_model

DIGITS = ("digits_ensemble", "digits_preprocess", "digits", "digits_postprocess")


def test_check_passes_the_shipped_repository() -> None:
    # The command the README recommends for CI, run as a user runs it.
    result = subprocess.run(
        [sys.executable, "-m", "geserve", "check", "--model-repository", str(MODEL_REPOSITORY)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    count = sum(1 for folder in MODEL_REPOSITORY.iterdir() if (folder / "config.pbtxt").is_file())
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1] == f"{count} model(s) checked: no problems"


def _digits(repository: Path) -> Path:
    for name in DIGITS:
        copy_model(name, repository)
    return repository / "digits_ensemble" / "config.pbtxt"


# What to change in digits_ensemble's config.pbtxt -> words of the server's reason at load.
BROKEN = {
    "unknown_model": (
        ('model_name: "digits"\n', 'model_name: "no_such_model"\n'),
        "ensemble digits_ensemble contains models that are not available: no_such_model",
    ),
    "unknown_input": (
        ('input_map { key: "pixels"', 'input_map { key: "PIXELS"'),
        "ensemble tensor pixels is mapping to non-existing input PIXELS in model digits",
    ),
    "unknown_output": (
        ('{ key: "SCORE" value: "SCORE" }', '{ key: "CONFIDENCE" value: "SCORE" }'),
        "ensemble tensor SCORE is mapped from non-existing output CONFIDENCE in model digits_postprocess",
    ),
    "wrong_dtype": (
        ('{ name: "SCORE" data_type: TYPE_FP32', '{ name: "SCORE" data_type: TYPE_INT32'),
        "ensemble tensor SCORE: inconsistent data type: TYPE_INT32 is inferred from model digits_ensemble while "
        "TYPE_FP32 is inferred from model digits_postprocess",
    ),
    "missing_version": (
        ('model_name: "digits"\n      model_version: -1', 'model_name: "digits"\n      model_version: 7'),
        "Request for unknown model: 'digits' version 7 is not found",
    ),
    "batch_too_large": (
        ("max_batch_size: 32", "max_batch_size: 64"),
        "ensemble digits_ensemble allows maximum batch size 64, but it contains model digits_preprocess",
    ),
}


@pytest.mark.parametrize("broken", sorted(BROKEN))
def test_check_reports_a_broken_ensemble(broken: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _digits(tmp_path)
    (old, new), words = BROKEN[broken]
    text = config.read_text()
    assert old in text
    config.write_text(text.replace(old, new, 1))
    assert main(["check", "--model-repository", str(tmp_path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == f"1 problem(s) in {len(DIGITS)} model(s)", lines
    assert lines[0].startswith(f"{config}: ensemble_scheduling: "), lines
    assert words in lines[0], lines


def test_an_ensemble_over_a_broken_model_or_ensemble_is_reported_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _digits(tmp_path)
    (tmp_path / "digits" / "1" / "model.onnx").unlink()
    outer = tmp_path / "outer" / "config.pbtxt"
    outer.parent.mkdir()
    (outer.parent / "1").mkdir()
    outer.write_text(
        'name: "outer" platform: "ensemble" max_batch_size: 32\n'
        'input [ { name: "IMAGE" data_type: TYPE_UINT8 dims: [ 8, 8 ] } ]\n'
        'output [ { name: "LABEL" data_type: TYPE_STRING dims: [ 1 ] } ]\n'
        'ensemble_scheduling { step [ { model_name: "digits_ensemble" model_version: -1\n'
        'input_map { key: "IMAGE" value: "IMAGE" } output_map { key: "LABEL" value: "LABEL" } } ] }\n'
    )
    assert main(["check", "--model-repository", str(tmp_path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == f"3 problem(s) in {len(DIGITS) + 1} model(s)", lines
    assert any(line.startswith(f"{tmp_path / 'digits' / '1' / 'model.onnx'}: ") for line in lines), lines
    assert (
        f"{tmp_path / 'digits_ensemble' / 'config.pbtxt'}: ensemble_scheduling: ensemble digits_ensemble contains models that are not available: digits"
        in lines
    )
    assert (
        f"{outer}: ensemble_scheduling: ensemble outer contains models that are not available: digits_ensemble" in lines
    )


def test_an_ensemble_over_an_identity_model_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Composing models whose config is complete in config.pbtxt: checked exactly as the server would at load.
    write_identity_model(tmp_path, "echo")
    (tmp_path / "echo_ensemble" / "1").mkdir(parents=True)
    (tmp_path / "echo_ensemble" / "config.pbtxt").write_text(
        'name: "echo_ensemble" platform: "ensemble" max_batch_size: 8\n'
        'input [ { name: "IN" data_type: TYPE_FP32 dims: [ 16 ] } ]\n'
        'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 16 ] } ]\n'
        'ensemble_scheduling { step [ { model_name: "echo" model_version: -1\n'
        'input_map { key: "INPUT0" value: "IN" } output_map { key: "OUTPUT0" value: "OUT" } } ] }\n'
    )
    assert main(["check", "--model-repository", str(tmp_path)]) == 0, capsys.readouterr().out


def test_a_step_on_a_self_completing_python_model_is_noted_not_failed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # auto_double declares its tensors in auto_complete_config: model code, which only the server runs.
    shutil.copytree(ROOT / "tests" / "python_models" / "auto_double", tmp_path / "auto_double")
    (tmp_path / "auto_double" / "config.pbtxt").write_text('backend: "python"\n')
    ensemble = tmp_path / "doubler" / "config.pbtxt"
    (ensemble.parent / "1").mkdir(parents=True)
    ensemble.write_text(
        'name: "doubler" platform: "ensemble" max_batch_size: 4\n'
        'input [ { name: "IN" data_type: TYPE_INT64 dims: [ 3 ] } ]\n'
        'output [ { name: "OUT" data_type: TYPE_INT64 dims: [ 3 ] } ]\n'
        'ensemble_scheduling { step [ { model_name: "auto_double" model_version: -1\n'
        'input_map { key: "X" value: "IN" } output_map { key: "Y" value: "OUT" } } ] }\n'
    )
    assert main(["check", "--model-repository", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "2 model(s) checked: no problems, 2 not checked", lines
    model = tmp_path / "auto_double" / "config.pbtxt"
    assert lines[0].startswith(
        f"{model}: model file: not checked: model 'auto_double' must specify at least one input"
    ), lines
    assert lines[1].startswith(f"{ensemble}: ensemble_scheduling: not checked: "), lines
    assert "non-existing input X in model auto_double" in lines[1], lines
    assert all(
        "auto_double: its auto_complete_config runs at load, in the server only" in line for line in lines[:2]
    ), lines


def test_a_step_on_a_ge_model_compiled_at_load_is_noted_not_failed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A `ge` model with only model.onnx: its outputs come from the .om that ATC compiles at load.
    (tmp_path / "affine" / "1").mkdir(parents=True)
    (tmp_path / "affine" / "1" / "model.onnx").write_bytes(affine_onnx())
    (tmp_path / "affine" / "config.pbtxt").write_text('backend: "ge" max_batch_size: 4\n')
    ensemble = tmp_path / "pipeline" / "config.pbtxt"
    (ensemble.parent / "1").mkdir(parents=True)
    ensemble.write_text(
        'name: "pipeline" platform: "ensemble" max_batch_size: 4\n'
        'input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
        'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        'ensemble_scheduling { step [ { model_name: "affine" model_version: -1\n'
        'input_map { key: "x" value: "IN" } output_map { key: "y" value: "OUT" } } ] }\n'
    )
    assert main(["check", "--model-repository", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "2 model(s) checked: no problems, 1 not checked", lines
    assert lines[0].startswith(f"{ensemble}: ensemble_scheduling: not checked: "), lines
    assert "affine: completed at load from the .om that ATC compiles" in lines[0], lines
