"""config.pbtxt parsing, defaults, checks and Triton's JSON form."""

from __future__ import annotations

from pathlib import Path

import pytest

from geserve._generated import model_config_pb2 as mc
from geserve.errors import ModelLoadError
from geserve.repository.config import (
    config_to_json,
    fill_defaults,
    parse_config_text,
    read_model_config,
    refuse_unsupported,
    validate_config,
)
from geserve.repository.scan import available_versions, scan_repositories, select_versions

SIMPLE = """
name: "simple"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] } ]
dynamic_batching { preferred_batch_size: [ 4, 8 ] max_queue_delay_microseconds: 100 }
parameters { key: "k" value: { string_value: "v" } }
"""


def test_parse_full_triton_config() -> None:
    config = parse_config_text(SIMPLE, "config.pbtxt")
    assert config.max_batch_size == 8
    assert list(config.dynamic_batching.preferred_batch_size) == [4, 8]
    assert config.parameters["k"].string_value == "v"


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ('name: "x"\nmax_batch_size: "eight"\n', 2),
        ('name: "x"\n\ninput [ { name: "a" data_type: TYPE_NOPE } ]\n', 3),
        ('name: "x"\nno_such_field: 1\n', 2),
    ],
)
def test_syntax_errors_name_file_and_line(text: str, line: int) -> None:
    with pytest.raises(ModelLoadError) as error:
        parse_config_text(text, "/repo/x/config.pbtxt")
    assert error.value.message.startswith(f"failed to parse /repo/x/config.pbtxt at line {line} column ")


def test_read_model_config(tmp_path: Path) -> None:
    folder = tmp_path / "simple"
    folder.mkdir()
    config, found = read_model_config(folder, "simple")
    assert (config.name, found) == ("simple", False)
    (folder / "config.pbtxt").write_text("max_batch_size: 2")
    config, found = read_model_config(folder, "simple")
    assert (config.name, config.max_batch_size, found) == ("simple", 2, True)
    (folder / "config.pbtxt").write_text('name: "other"')
    with pytest.raises(
        ModelLoadError, match=r"unexpected 'name' in model configuration .*: expected 'simple', got 'other'"
    ):
        read_model_config(folder, "simple")


def test_fill_defaults_like_triton() -> None:
    config = parse_config_text(SIMPLE, "c")
    fill_defaults(config, "onnxruntime", "model.onnx", mc.ModelInstanceGroup.KIND_CPU)
    assert config.backend == "onnxruntime"
    assert config.default_model_filename == "model.onnx"
    assert config.version_policy.latest.num_versions == 1
    assert [(g.name, g.kind, g.count) for g in config.instance_group] == [("simple", mc.ModelInstanceGroup.KIND_CPU, 1)]
    two_groups = parse_config_text('name: "m" instance_group [ { count: 2 }, { kind: KIND_GPU gpus: [0, 1] } ]', "c")
    fill_defaults(two_groups, "onnxruntime", "model.onnx", mc.ModelInstanceGroup.KIND_CPU)
    assert [(g.name, g.kind, g.count) for g in two_groups.instance_group] == [
        ("m_0", mc.ModelInstanceGroup.KIND_CPU, 2),
        ("m_1", mc.ModelInstanceGroup.KIND_GPU, 1),
    ]


def test_json_form_prints_like_triton() -> None:
    config = parse_config_text(SIMPLE, "c")
    fill_defaults(config, "onnxruntime", "model.onnx", mc.ModelInstanceGroup.KIND_CPU)
    data = config_to_json(config)
    assert list(data)[:6] == ["name", "platform", "backend", "runtime", "version_policy", "max_batch_size"]
    assert data["input"][0]["dims"] == [16]  # int64 as JSON numbers, not strings
    assert data["input"][0]["data_type"] == "TYPE_INT32"
    assert data["dynamic_batching"]["max_queue_delay_microseconds"] == 100
    assert data["dynamic_batching"]["priority_levels"] == 0
    assert data["dynamic_batching"]["preferred_batch_size"] == [4, 8]
    assert data["parameters"] == {"k": {"string_value": "v"}}
    assert data["model_transaction_policy"] == {"decoupled": False}
    assert "sequence_batching" not in data and "ensemble_scheduling" not in data
    assert data["instance_group"][0]["kind"] == "KIND_CPU"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('name: "m" input [ { name: "i" data_type: TYPE_FP32 dims: [1] } ]', "must specify at least one output"),
        (
            'name: "m" input [ { name: "i" dims: [1] } ] output [ { name: "o" data_type: TYPE_FP32 dims: [1] } ]',
            "input 'i' must specify 'data_type'",
        ),
        (
            'name: "m" input [ { name: "i" data_type: TYPE_FP32 dims: [0] } ] '
            'output [ { name: "o" data_type: TYPE_FP32 dims: [1] } ]',
            "dimension 0 is invalid",
        ),
        (
            'name: "m" input [ { name: "i" data_type: TYPE_FP32 dims: [1] }, { name: "i" data_type: TYPE_FP32 dims: [1] } ] '
            'output [ { name: "o" data_type: TYPE_FP32 dims: [1] } ]',
            "more than one input named 'i'",
        ),
        (
            'name: "m" max_batch_size: 4 dynamic_batching { preferred_batch_size: [8] } '
            'input [ { name: "i" data_type: TYPE_FP32 dims: [1] } ] output [ { name: "o" data_type: TYPE_FP32 dims: [1] } ]',
            "preferred_batch_size 8 must be in [1, max_batch_size 4]",
        ),
    ],
)
def test_validate_config(text: str, message: str) -> None:
    with pytest.raises(ModelLoadError, match=message.replace("[", r"\[").replace("]", r"\]")):
        validate_config(parse_config_text(text, "c"))


def test_versions_and_policies(tmp_path: Path) -> None:
    for name in ("1", "2", "10", "010", "0", "abc"):
        (tmp_path / name).mkdir()
    (tmp_path / "3").write_text("a file, not a version folder")
    assert available_versions(tmp_path) == [1, 2, 10]
    policy = mc.ModelVersionPolicy()
    assert select_versions([1, 2, 10], policy) == [10]
    policy.latest.num_versions = 2
    assert select_versions([1, 2, 10], policy) == [2, 10]
    policy.all.SetInParent()
    assert select_versions([1, 2, 10], policy) == [1, 2, 10]
    policy.specific.versions.extend([2, 7])
    assert select_versions([1, 2, 10], policy) == [2]
    assert select_versions([], mc.ModelVersionPolicy()) == []


def test_scan_finds_conflicts(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    for repository in (first, second):
        (repository / "shared").mkdir(parents=True)
    (first / "only_first").mkdir()
    (first / ".hidden").mkdir()
    (first / "file.txt").write_text("")
    result = scan_repositories([first, second])
    assert list(result.models) == ["only_first"]
    assert "appears in multiple repositories" in result.conflicts["shared"]
    with pytest.raises(FileNotFoundError):
        scan_repositories([tmp_path / "missing"])


TENSORS = 'input [ { name: "i" data_type: TYPE_FP32 dims: [1] %s } ] output [ { name: "o" data_type: TYPE_FP32 dims: [1] %s } ]'


@pytest.mark.parametrize(
    ("input_extra", "output_extra", "message"),
    [
        ("is_shape_tensor: true", "", "model 'm' input 'i': is_shape_tensor is not supported by geserve"),
        ("", "is_shape_tensor: true", "model 'm' output 'o': is_shape_tensor is not supported by geserve"),
        ("is_non_linear_format_io: true", "", "input 'i': is_non_linear_format_io is not supported by geserve"),
        ("", "is_non_linear_format_io: true", "output 'o': is_non_linear_format_io is not supported by geserve"),
    ],
)
def test_tensorrt_tensor_properties_are_refused(input_extra: str, output_extra: str, message: str) -> None:
    config = parse_config_text(f'name: "m" {TENSORS % (input_extra, output_extra)}', "c")
    with pytest.raises(ModelLoadError, match=message):
        refuse_unsupported(config)
    refuse_unsupported(parse_config_text(f'name: "m" {TENSORS % ("", "")}', "c"))  # without them it loads


@pytest.mark.parametrize(
    ("header", "allowed"),
    [
        ('backend: "onnxruntime"', True),
        ('backend: "onnxruntime" runtime: "libtriton_onnxruntime.so"', True),
        ('platform: "onnxruntime_onnx" runtime: "libtriton_onnxruntime.so"', True),
        ('backend: "python" runtime: "libtriton_python.so"', True),
        ('backend: "onnxruntime" runtime: "libtriton_tensorrt.so"', False),
        ('backend: "python" runtime: "model.py"', False),
        ('runtime: "libcustom.so"', False),
    ],
)
def test_runtime_must_name_the_configs_own_backend(header: str, allowed: bool) -> None:
    config = parse_config_text(f'name: "m" {header} {TENSORS % ("", "")}', "c")
    if allowed:
        refuse_unsupported(config)
    else:
        with pytest.raises(ModelLoadError, match=r"runtime '.*' is not supported: geserve's backends are built in"):
            refuse_unsupported(config)


def test_a_config_without_inputs_is_valid() -> None:
    """Triton has no rule that a model takes inputs: one that declares only outputs loads."""
    validate_config(parse_config_text('name: "m" output [ { name: "o" data_type: TYPE_FP32 dims: [1] } ]', "c"))
