"""`geserve inspect` and `geserve check`: offline, with no NPU and no pyACL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from geserve.cli import main
from tests.fakes.om_models import affine_description, write_affine_om
from tests.fakes.om_writer import write_om
from tests.support import ROOT, copy_model

SAMPLES = ROOT / "tests" / "data" / "om-samples"


def test_inspect_json_has_the_keys_and_values_of_expected_json(capsys: pytest.CaptureFixture[str]) -> None:
    expected = json.loads((SAMPLES / "expected.json").read_text())
    for name in ("synthetic_dynbatch.om", "ddnet_out.om"):
        assert main(["inspect", "--json", str(SAMPLES / name)]) == 0
        assert json.loads(capsys.readouterr().out) == expected[name]


def test_inspect_prints_a_config_that_serves_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The synthetic sample's model as the writer lays it out, with the `_dynamic_output_dims` ATC writes.
    synthetic = json.loads((SAMPLES / "expected.json").read_text())["synthetic_dynbatch.om"]
    assert main(["inspect", str(write_om(tmp_path / "model.om", synthetic)), "--name", "classifier"]) == 0
    out = capsys.readouterr().out
    assert "0: input  float32  [-1, 3, 224, 224]  NCHW" in out
    assert "1: ascend_mbatch_shape_data  int32  [1]  ND  (filled by the runtime with the gear)" in out
    assert "0: prob:0:prob  float32  [8, 1000]  ND" in out
    assert "gears: batch [1, 2, 4, 8] (inputs ['input'])" in out
    assert 'name: "classifier"' in out and "max_batch_size: 8" in out and 'name: "prob"' in out


def test_inspect_says_the_synthetic_sample_lacks_output_dims_at_its_gears(capsys: pytest.CaptureFixture[str]) -> None:
    """Its `_dynamic_output_dims` name outputs 1, 2, 4 and 8, none its output 0: described, not servable."""
    path = SAMPLES / "synthetic_dynbatch.om"
    assert main(["inspect", str(path), "--name", "classifier"]) == 1
    out = capsys.readouterr().out
    assert "gears: batch [1, 2, 4, 8] (inputs ['input'])" in out
    assert f"not servable by geserve: model 'classifier': '{path}' has batch gears [1, 2, 4, 8]" in out
    assert "give no dims for output 0 'prob:0:prob' at batch sizes 1, 2, 4, 8" in out
    assert "aclmdlGetCurOutputDims cannot give those outputs' shapes once a batch size is set" in out
    assert "compile the model again with ATC" in out and "config.pbtxt that serves it" not in out


def test_inspect_refuses_the_encrypted_sample(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(SAMPLES / "modelbox_2d_2048_w_stage1_pad0_en.om")]) == 1
    assert "no IMOD magic (encrypted by the application that shipped it)" in capsys.readouterr().err


def _good_repository(root: Path) -> Path:
    repository = root / "models"
    write_affine_om(repository / "affine" / "1" / "model.om", gears=[1, 2, 4])
    (repository / "affine" / "config.pbtxt").write_text(
        'name: "affine" backend: "ge" max_batch_size: 4\n'
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
        'output [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
    )
    write_affine_om(repository / "affine_auto" / "1" / "model.om", static_batch=2)
    copy_model("simple", repository)
    copy_model("simple_identity", repository)
    return repository


def test_check_passes_a_good_repository(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--model-repository", str(_good_repository(tmp_path))]) == 0
    assert "4 model(s) checked: no problems" in capsys.readouterr().out


# model folder -> (what to break, the file and field its one line names, words of the message)
MISTAKES = {
    "bad_text": ("config.pbtxt", "config", "max_batch_size: four"),
    "bad_backend": ("config.pbtxt", "backend", "unknown backend 'tensorrt'"),
    "no_version": ("config.pbtxt", "version_policy", "at least one version must be available"),
    "no_file": ("1/model.om", "default_model_filename", "version 1's model file does not exist"),
    "big_batch": ("config.pbtxt", "max_batch_size", "config max_batch_size 16 exceeds"),
    "wrong_output": ("config.pbtxt", "output", "config output 'logits' is not in"),
    "wrong_dims": ("config.pbtxt", "input", "input 'INPUT0' has dims [-1] + [8] in the config"),
    "missing_path": ("config.pbtxt", "parameters.model_path", "names no file: looked at"),
    "not_an_om": ("1/model.om", "model file", "no IMOD magic"),
    "gear_without_dims": ("1/model.om", "model file", "give no dims for output 1 'ReduceSum_2:0:s' at batch size 2"),
}


def _break(repository: Path, name: str) -> None:
    folder = repository / name
    affine = 'backend: "ge" max_batch_size: 4 input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]'
    if name == "bad_text":
        (folder / "1").mkdir(parents=True)
        (folder / "config.pbtxt").write_text('backend: "ge" max_batch_size: four')
    elif name == "bad_backend":
        (folder / "1").mkdir(parents=True)
        (folder / "config.pbtxt").write_text('backend: "tensorrt"')
    elif name == "no_version":
        folder.mkdir()
        (folder / "config.pbtxt").write_text(affine)
    elif name == "no_file":
        (folder / "1").mkdir(parents=True)
        (folder / "config.pbtxt").write_text(affine)
    elif name == "big_batch":
        write_affine_om(folder / "1" / "model.om", gears=[1, 2, 4, 8])
        (folder / "config.pbtxt").write_text(affine.replace("max_batch_size: 4", "max_batch_size: 16"))
    elif name == "wrong_output":
        write_affine_om(folder / "1" / "model.om", gears=[1, 2, 4])
        (folder / "config.pbtxt").write_text(affine + ' output [ { name: "logits" data_type: TYPE_FP32 dims: [ 4 ] } ]')
    elif name == "wrong_dims":
        copy_model("simple", repository, name)
        text = (folder / "config.pbtxt").read_text().replace('name: "simple"', f'name: "{name}"')
        (folder / "config.pbtxt").write_text(text.replace("dims: [ 16 ]", "dims: [ 8 ]", 1))
    elif name == "missing_path":
        write_affine_om(folder / "1" / "model.om", gears=[1, 2, 4])
        (folder / "config.pbtxt").write_text(
            affine + ' parameters { key: "model_path" value { string_value: "x.om" } }'
        )
    elif name == "gear_without_dims":
        # ATC's entries for the affine graph at gears 1, 2, 4, less output 1's at gear index 1 (batch 2).
        entries = ["0,0,1,4", "1,0,2,4", "2,0,4,4", "0,1,1,1", "2,1,4,1"]
        write_om(folder / "1" / "model.om", affine_description([1, 2, 4]), dynamic_output_dims=entries)
        (folder / "config.pbtxt").write_text(affine)
    elif name == "not_an_om":
        (folder / "1").mkdir(parents=True)
        (folder / "1" / "model.om").write_bytes(b"\x00" * 512)
        (folder / "config.pbtxt").write_text(affine)


def test_check_reports_each_mistake_on_one_line_naming_file_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repository = _good_repository(tmp_path)
    for name in MISTAKES:
        _break(repository, name)
    assert main(["check", "--model-repository", str(repository)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == f"{len(MISTAKES)} problem(s) in {len(MISTAKES) + 4} model(s)"
    problems = lines[:-1]
    assert len(problems) == len(MISTAKES), problems
    for name, (file, field, words) in MISTAKES.items():
        line = next((line for line in problems if line.startswith(f"{repository / name / file}: ")), None)
        assert line is not None, (name, problems)
        assert line.startswith(f"{repository / name / file}: {field}: "), line
        assert words in line, line
