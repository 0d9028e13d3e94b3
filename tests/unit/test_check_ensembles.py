"""`geserve check` on ensembles: the shipped repository passes, and each broken ensemble is named with its reason."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from geserve._generated import model_config_pb2 as mc
from geserve.batching.sequence import SequenceInstances
from geserve.cli import main
from geserve.core.repository import ModelRepository
from geserve.repository.scan import ModelSource
from geserve.settings import RepositorySettings
from tests.fakes.om_models import affine_onnx
from tests.support import MODEL_REPOSITORY, ROOT, config_text, copy_model, write_identity_model

DIGITS = ("digits_ensemble", "digits_preprocess", "digits", "digits_postprocess")


def test_check_passes_the_shipped_repository() -> None:
    # The command docs/ascend.md recommends for CI, run as a user runs it.
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


def _affine(repository: Path, config: str = 'backend: "ge" max_batch_size: 4\n') -> None:
    """A `ge` model with only model.onnx, which ATC compiles at load."""
    (repository / "affine" / "1").mkdir(parents=True)
    (repository / "affine" / "1" / "model.onnx").write_bytes(affine_onnx())
    (repository / "affine" / "config.pbtxt").write_text(config)


def _ensemble(
    repository: Path,
    name: str,
    steps: list[tuple[str, str, str]],
    batch: int = 4,
    inputs: tuple[tuple[str, str, str], ...] = (("IN", "TYPE_FP32", "4"),),
    outputs: tuple[tuple[str, str, str], ...] = (("OUT", "TYPE_FP32", "4"),),
) -> Path:
    """An ensemble of steps (model, input_map, output_map entries), by default IN -> OUT (FP32 [4]); its config."""
    config = repository / name / "config.pbtxt"
    (config.parent / "1").mkdir(parents=True)
    step_text = ", ".join(
        f'{{ model_name: "{model}" model_version: -1 {input_map} {output_map} }}'
        for model, input_map, output_map in steps
    )
    scheduling = f"ensemble_scheduling {{ step [ {step_text} ] }}"
    text = config_text(
        name, platform="ensemble", max_batch_size=batch, inputs=inputs, outputs=outputs, extra=scheduling
    )
    config.write_text(text)
    return config


AFFINE_STEP = ("affine", 'input_map { key: "x" value: "IN" }', 'output_map { key: "y" value: "OUT" }')
AFFINE_MID_STEP = ("affine", 'input_map { key: "x" value: "MID" }', 'output_map { key: "y" value: "OUT" }')


def test_an_ensemble_over_a_broken_model_or_ensemble_is_reported_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _digits(tmp_path)
    (tmp_path / "digits" / "1" / "model.onnx").unlink()
    outer = _ensemble(
        tmp_path,
        "outer",
        [
            (
                "digits_ensemble",
                'input_map { key: "IMAGE" value: "IMAGE" }',
                'output_map { key: "LABEL" value: "LABEL" }',
            )
        ],
        batch=32,
        inputs=(("IMAGE", "TYPE_UINT8", "8, 8"),),
        outputs=(("LABEL", "TYPE_STRING", "1"),),
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
    _ensemble(
        tmp_path,
        "echo_ensemble",
        [("echo", 'input_map { key: "INPUT0" value: "IN" }', 'output_map { key: "OUTPUT0" value: "OUT" }')],
        batch=8,
        inputs=(("IN", "TYPE_FP32", "16"),),
        outputs=(("OUT", "TYPE_FP32", "16"),),
    )
    assert main(["check", "--model-repository", str(tmp_path)]) == 0, capsys.readouterr().out


def test_a_step_on_a_self_completing_python_model_is_noted_not_failed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # auto_double declares its tensors in auto_complete_config: model code, which only the server runs.
    shutil.copytree(ROOT / "tests" / "python_models" / "auto_double", tmp_path / "auto_double")
    (tmp_path / "auto_double" / "config.pbtxt").write_text('backend: "python"\n')
    ensemble = _ensemble(
        tmp_path,
        "doubler",
        [("auto_double", 'input_map { key: "X" value: "IN" }', 'output_map { key: "Y" value: "OUT" }')],
        inputs=(("IN", "TYPE_INT64", "3"),),
        outputs=(("OUT", "TYPE_INT64", "3"),),
    )
    assert main(["check", "--model-repository", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "2 model(s) checked: no problems, 2 not checked", lines
    model = tmp_path / "auto_double" / "config.pbtxt"
    assert lines[0].startswith(
        f"{model}: model file: not checked: model 'auto_double' must specify at least one output"
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
    _affine(tmp_path)
    ensemble = _ensemble(tmp_path, "pipeline", [AFFINE_STEP], outputs=(("OUT", "TYPE_FP32", "1"),))
    assert main(["check", "--model-repository", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "2 model(s) checked: no problems, 1 not checked", lines
    assert lines[0].startswith(f"{ensemble}: ensemble_scheduling: not checked: "), lines
    assert "affine: completed at load from the .om that ATC compiles" in lines[0], lines


def _check(repository: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    code = main(["check", "--model-repository", str(repository)])
    return code, capsys.readouterr().out.splitlines()


def test_a_missing_model_beside_a_step_compiled_at_load_is_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # No completion makes a model that is not in the repository available.
    _affine(tmp_path)
    ensemble = _ensemble(
        tmp_path,
        "pipeline",
        [
            AFFINE_MID_STEP,
            ("no_such_model", 'input_map { key: "a" value: "IN" }', 'output_map { key: "b" value: "MID" }'),
        ],
    )
    code, lines = _check(tmp_path, capsys)
    assert code == 1, lines
    assert lines == [
        f"{ensemble}: ensemble_scheduling: ensemble pipeline contains models that are not available: no_such_model",
        "1 problem(s) in 2 model(s)",
    ]


def test_a_broken_step_beside_a_noted_one_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # affine's step alone would be noted (its config declares no input x yet); echo's, checked in full, cannot load.
    _affine(tmp_path)
    write_identity_model(tmp_path, "echo", dtype="TYPE_INT32", dims="4")
    ensemble = _ensemble(
        tmp_path,
        "pipeline",
        [
            AFFINE_MID_STEP,
            ("echo", 'input_map { key: "INPUT0" value: "IN" }', 'output_map { key: "OUTPUT0" value: "MID" }'),
        ],
    )
    code, lines = _check(tmp_path, capsys)
    assert code == 1, lines
    assert lines == [
        f"{ensemble}: ensemble_scheduling: in ensemble pipeline, ensemble tensor IN: inconsistent data type: "
        "TYPE_FP32 is inferred from model pipeline while TYPE_INT32 is inferred from model echo",
        "1 problem(s) in 3 model(s)",
    ]


# What affine's config.pbtxt declares -> what check says of its step; load completes only what a config leaves out.
AFFINE_CONFIGS = {
    "data_type_left_out": (
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ] output [ { name: "y" dims: [ 4 ] } ]',
        0,
        "not checked: in ensemble pipeline, ensemble tensor OUT: inconsistent data type: TYPE_FP32 is inferred from "
        "model pipeline while TYPE_INVALID is inferred from model affine",
    ),
    "data_type_declared": (
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ] '
        'output [ { name: "y" data_type: TYPE_INT32 dims: [ 4 ] } ]',
        1,
        "in ensemble pipeline, ensemble tensor OUT: inconsistent data type: TYPE_FP32 is inferred from model "
        "pipeline while TYPE_INT32 is inferred from model affine",
    ),
    "dims_declared": (
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ] '
        'output [ { name: "y" data_type: TYPE_FP32 dims: [ 2, 2 ] } ]',
        1,
        "in ensemble pipeline, ensemble tensor OUT: inconsistent shape: [-1, 4] is inferred from model pipeline "
        "while [-1, 2, 2] is inferred from model affine",
    ),
    "max_batch_size_declared": (
        # Completion keeps a max_batch_size the config sets (backends.acl.completion).
        "",
        1,
        "ensemble pipeline allows maximum batch size 8, but it contains model affine which only allows maximum "
        "batch size to be 4",
    ),
}


@pytest.mark.parametrize("case", sorted(AFFINE_CONFIGS))
def test_only_what_completion_could_fill_is_noted(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    declared, code, words = AFFINE_CONFIGS[case]
    _affine(tmp_path, f'backend: "ge" max_batch_size: 4\n{declared}\n')
    ensemble = _ensemble(tmp_path, "pipeline", [AFFINE_STEP], batch=8 if case == "max_batch_size_declared" else 4)
    assert _check(tmp_path, capsys) == (
        code,
        [
            f"{ensemble}: ensemble_scheduling: {words}"
            + (
                ", as read from config.pbtxt (affine: completed at load from the .om that ATC compiles)"
                if not code
                else ""
            ),
            "2 model(s) checked: no problems, 1 not checked" if not code else "1 problem(s) in 2 model(s)",
        ],
    )


# auto_double's config.pbtxt beyond its backend -> the line check prints: a note where auto_complete_config could
# complete the config (it sets max_batch_size 4), a problem where nothing it may do could (each fails its load).
AUTO_DOUBLE_CONFIGS = {
    "negative_max_batch_size": (
        "max_batch_size: -1",
        "max_batch_size: model 'auto_double': max_batch_size must be >= 0, got -1",
    ),
    "zero_dim_behind_no_input": (
        'output [ { name: "Y" data_type: TYPE_INT64 dims: [ 0 ] } ]',
        "output: model 'auto_double' output 'Y' dimension 0 is invalid: dims must be positive or -1",
    ),
    "preferred_batch_over_a_set_max": (
        "max_batch_size: 2 dynamic_batching { preferred_batch_size: [ 4 ] }",
        "max_batch_size: model 'auto_double': preferred_batch_size 4 must be in [1, max_batch_size 2]",
    ),
    "instance_count": (
        "instance_group [ { kind: KIND_CPU count: -1 } ]",
        "config: instance group 'auto_double' of model 'auto_double' asks for -1 instances; count must be between 1 "
        "and 64",
    ),
    "preferred_batch_without_a_max": (
        "dynamic_batching { preferred_batch_size: [ 4 ] }",
        "model file: not checked: model 'auto_double' must specify at least one output, as read from config.pbtxt "
        "(auto_double: its auto_complete_config runs at load, in the server only)",
    ),
}


@pytest.mark.parametrize("case", sorted(AUTO_DOUBLE_CONFIGS))
def test_a_self_completing_python_model_fails_on_what_auto_complete_cannot_fix(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shutil.copytree(ROOT / "tests" / "python_models" / "auto_double", tmp_path / "auto_double")
    extra, words = AUTO_DOUBLE_CONFIGS[case]
    config = tmp_path / "auto_double" / "config.pbtxt"
    config.write_text(f'backend: "python"\n{extra}\n')
    noted = "not checked" in words
    assert _check(tmp_path, capsys) == (
        0 if noted else 1,
        [
            f"{config}: {words}",
            "1 model(s) checked: no problems, 1 not checked" if noted else "1 problem(s) in 1 model(s)",
        ],
    )


class _NoWorkers:
    """Ensembles start no instances: loading only them needs no pool."""

    segment_prefix = "unused"

    def complete(self, config: mc.ModelConfig, source: ModelSource, versions: list[int]) -> None:
        raise AssertionError(f"only ensembles load here, not '{config.name}'")

    async def create(
        self, source: ModelSource, config: mc.ModelConfig, version: int
    ) -> tuple[SequenceInstances, mc.ModelConfig]:
        raise AssertionError(f"only ensembles load here, not '{config.name}'")


def _server_failures(repository: Path) -> dict[str, str]:
    """What the server says of each model it fails to load from `repository` at startup."""
    models = ModelRepository(RepositorySettings(paths=(repository,)), _NoWorkers())
    return asyncio.run(models.load_startup())


# Ensemble -> the model its one step uses. The server loads ensembles that wait on each other one at a time, in
# name order (core.repository.ModelRepository.load_startup): each finds those after it, itself among them, not loaded.
CYCLES = {
    "two_ensembles": {"ens_a": "ens_b", "ens_b": "ens_a"},
    "self_reference": {"selfie": "selfie"},
    "over_a_cycle": {"ens_a": "ens_b", "ens_b": "ens_a", "outer": "ens_a"},
}


@pytest.mark.parametrize("case", sorted(CYCLES))
def test_ensembles_in_a_cycle_fail_as_the_server_fails_them(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    steps = CYCLES[case]
    for name, model in steps.items():
        _ensemble(
            tmp_path, name, [(model, 'input_map { key: "IN" value: "IN" }', 'output_map { key: "OUT" value: "OUT" }')]
        )
    failures = _server_failures(tmp_path)
    assert sorted(failures) == sorted(steps), failures
    code, lines = _check(tmp_path, capsys)
    assert code == 1, lines
    reasons = {
        name: f"version 1: ensemble {name} contains models that are not available: {model}"
        for name, model in steps.items()
    }
    assert failures == reasons
    assert lines == [
        *(
            f"{tmp_path / name / 'config.pbtxt'}: ensemble_scheduling: {reason.removeprefix('version 1: ')}"
            for name, reason in sorted(reasons.items())
        ),
        f"{len(steps)} problem(s) in {len(steps)} model(s)",
    ]
