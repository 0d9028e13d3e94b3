"""A `ge` config's input shapes checked against model.onnx's before ATC compiles it: the ATC command, `geserve
check`, the stand-in atc's rank check, and the batch dim a config written for Triton's GE backend leaves out."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from onnx import TensorProto, helper, numpy_helper

from geserve._generated import model_config_pb2 as mc
from geserve.atc import command, compiler, graph_inputs
from geserve.backends.acl import completion
from geserve.backends.acl.om_file import read_description
from geserve.cli import main
from geserve.errors import ModelLoadError
from tests.fakes import atc as fake_atc
from tests.fakes.om_models import onnx_bytes

# What Huawei's GE Triton backend write-up gives for a ResNet-50 whose ONNX input is [N, 3, 224, 224]: no
# max_batch_size, dims without the batch dim.
GE_STYLE = """
name: "resnet"
backend: "ge"
input [ { name: "input" data_type: TYPE_FP32 format: FORMAT_NCHW dims: [ 3, 224, 224 ] } ]
output [ { name: "output" data_type: TYPE_FP32 dims: [ 3, 224, 224 ] } ]
"""


def _config(text: str) -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())


def _relu(folder: Path, shape: list[int | str]) -> Path:
    """model.onnx of a Relu from `input` to `output`, both of `shape` (a str dim is symbolic)."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["input"], ["output"])],
        "relu",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, shape)],
    )
    onnx = folder / "1" / "model.onnx"
    onnx.parent.mkdir(parents=True, exist_ok=True)
    onnx.write_bytes(onnx_bytes(graph))
    return onnx


def _input_shape(config: mc.ModelConfig, onnx: Path) -> str:
    """The --input_shape argument of the ATC command the load builds."""
    return command.build(graph_inputs.complete_inputs(config, onnx), "Ascend310P3", []).arguments[0]


def test_a_ge_style_config_compiles_with_the_graphs_open_batch_dim_as_1_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    onnx = _relu(tmp_path, ["N", 3, 224, 224])
    with caplog.at_level(logging.WARNING, logger="geserve.atc.graph_inputs"):
        assert _input_shape(_config(GE_STYLE), onnx) == "--input_shape=input:1,3,224,224"
    [record] = caplog.records
    assert record.getMessage() == (
        f"model 'resnet': config input 'input' has dims [3, 224, 224] and no max_batch_size, one dim short of input "
        f"'input' of '{onnx}' (shape [-1, 3, 224, 224]): ATC compiles it as --input_shape=input:1,3,224,224, a batch "
        "of 1, as the graph leaves its first dim open and a config without max_batch_size batches no requests (give "
        "max_batch_size to compile batch gears instead); as for a shipped .om of that shape, load then completes "
        "max_batch_size to 1 (auto-complete, where the .om's outputs lead with the same batch dim) and clients send "
        "[1, 3, 224, 224]"
    )


def test_a_ge_style_config_compiles_with_the_graphs_fixed_batch_dim(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    onnx = _relu(tmp_path, [8, 3, 224, 224])
    with caplog.at_level(logging.WARNING, logger="geserve.atc.graph_inputs"):
        assert _input_shape(_config(GE_STYLE), onnx) == "--input_shape=input:8,3,224,224"
    assert "ATC compiles it as --input_shape=input:8,3,224,224, the graph's fixed batch dim" in caplog.text
    assert "clients send [n, 3, 224, 224] with n up to 8" in caplog.text


def test_configs_at_the_graphs_rank_compile_as_before_without_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    onnx = _relu(tmp_path, ["N", 3, 224, 224])
    batched = _config(GE_STYLE.replace('backend: "ge"', 'backend: "ge" max_batch_size: 8'))
    whole = _config(GE_STYLE.replace("dims: [ 3, 224, 224 ] } ]\noutput", "dims: [ 2, 3, 224, 224 ] } ]\noutput"))
    with caplog.at_level(logging.WARNING, logger="geserve.atc.graph_inputs"):
        assert _input_shape(batched, onnx) == "--input_shape=input:-1,3,224,224"
        assert _input_shape(whole, onnx) == "--input_shape=input:2,3,224,224"
        # max_batch_size 1 compiles a batch of 1, which the graph's fixed batch dim of 1 is.
        single = _config(GE_STYLE.replace('backend: "ge"', 'backend: "ge" max_batch_size: 1'))
        assert _input_shape(single, _relu(tmp_path / "fixed", [1, 3, 224, 224])) == "--input_shape=input:1,3,224,224"
    assert not caplog.records


def test_any_other_rank_is_refused_naming_both_shapes(tmp_path: Path) -> None:
    onnx = _relu(tmp_path, ["N", 3, 224, 224])
    short = _config(GE_STYLE.replace("dims: [ 3, 224, 224 ] } ]\noutput", "dims: [ 224, 224 ] } ]\noutput"))
    with pytest.raises(ModelLoadError) as caught:
        graph_inputs.complete_inputs(short, onnx)
    assert caught.value.message == (
        "model 'resnet': config input 'input' gives ATC --input_shape=input:224,224 (dims [224, 224]), 2 dims, but "
        f"input 'input' of '{onnx}' has shape [-1, 3, 224, 224], 4 dims; ATC refuses an input shape whose rank is not "
        "the graph's"
    )
    with_batch = _config(
        GE_STYLE.replace('backend: "ge"', 'backend: "ge" max_batch_size: 8').replace("[ 3, 224", "[ 1, 3, 224", 1)
    )
    with pytest.raises(ModelLoadError) as caught:
        graph_inputs.complete_inputs(with_batch, onnx)
    assert caught.value.message == (
        "model 'resnet': config input 'input' gives ATC --input_shape=input:-1,1,3,224,224 (dims [1, 3, 224, 224] "
        f"after batch dim -1), 5 dims, but input 'input' of '{onnx}' has shape [-1, 3, 224, 224], 4 dims; ATC "
        "refuses an input shape whose rank is not the graph's; with max_batch_size > 0, dims leave the batch dim out"
    )


def test_a_fixed_graph_batch_with_max_batch_size_is_refused_as_onnx_runtime_refuses_it(tmp_path: Path) -> None:
    onnx = _relu(tmp_path, [1, 3, 224, 224])
    batched = _config(GE_STYLE.replace('backend: "ge"', 'backend: "ge" max_batch_size: 8'))
    with pytest.raises(ModelLoadError) as caught:
        graph_inputs.complete_inputs(batched, onnx)
    assert caught.value.message == (
        "model 'resnet': config input 'input' gives ATC --input_shape=input:-1,3,224,224 (dims [3, 224, 224] after "
        f"batch dim -1), but input 'input' has fixed first dimension 1 in '{onnx}' (shape [1, 3, 224, 224]), so the "
        "model cannot batch; set max_batch_size to 0"
    )


def test_a_dim_the_graph_fixes_at_another_value_is_refused_with_or_without_the_batch_dim(tmp_path: Path) -> None:
    onnx = _relu(tmp_path, ["N", 3, 224, 224])
    wider = _config(GE_STYLE.replace("dims: [ 3, 224, 224 ] } ]\noutput", "dims: [ 3, 256, 224 ] } ]\noutput"))
    with pytest.raises(ModelLoadError) as caught:
        graph_inputs.complete_inputs(wider, onnx)
    assert caught.value.message == (
        "model 'resnet': config input 'input' gives ATC --input_shape=input:1,3,256,224 (dims [3, 256, 224] after "
        f"batch dim 1, the graph leaves it open), but input 'input' of '{onnx}' has shape [-1, 3, 224, 224]: dim 2 "
        "is 256 where the graph fixes it at 224"
    )
    whole = _config(GE_STYLE.replace("dims: [ 3, 224, 224 ] } ]\noutput", "dims: [ 1, 4, 224, 224 ] } ]\noutput"))
    with pytest.raises(ModelLoadError, match=r"dim 1 is 4 where the graph fixes it at 3"):
        graph_inputs.complete_inputs(whole, onnx)


def test_preferred_batch_sizes_the_inferred_batch_cannot_hold_and_unknown_inputs_are_refused(tmp_path: Path) -> None:
    onnx = _relu(tmp_path, ["N", 3, 224, 224])
    preferring = _config(GE_STYLE + "dynamic_batching { preferred_batch_size: [ 4, 8 ] }")
    with pytest.raises(ModelLoadError) as caught:
        graph_inputs.complete_inputs(preferring, onnx)
    assert caught.value.message == (
        "model 'resnet': config input 'input' has dims [3, 224, 224] and no max_batch_size, one dim short of input "
        f"'input' of '{onnx}' (shape [-1, 3, 224, 224]), so ATC compiles it with batch dim 1, smaller than "
        "preferred_batch_size [4, 8]; give max_batch_size (ATC then compiles batch gears where the graph leaves the "
        "batch open) or preferred sizes that the graph's batch dim holds"
    )
    renamed = _config(GE_STYLE.replace('name: "input"', 'name: "images"'))
    with pytest.raises(
        ModelLoadError, match=r"config input 'images' is not an input of '.*', whose inputs are \['input'\]"
    ):
        graph_inputs.complete_inputs(renamed, onnx)


def test_onnxruntime_reads_the_graph_where_onnx_is_not_installed_and_without_either_inputs_go_unchecked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    onnx = _relu(tmp_path, ["N", 3, 224, 224])
    monkeypatch.setitem(sys.modules, "onnx", None)  # import onnx raises ImportError
    assert _input_shape(_config(GE_STYLE), onnx) == "--input_shape=input:1,3,224,224"
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with caplog.at_level(logging.INFO, logger="geserve.atc.graph_inputs"):
        assert _input_shape(_config(GE_STYLE), onnx) == "--input_shape=input:3,224,224"
    assert "config inputs go to ATC unchecked" in caplog.text and "geserve[onnx]" in caplog.text
    with pytest.raises(ModelLoadError, match=r"needs its inputs' names and dims: list them in config\.pbtxt"):
        graph_inputs.complete_inputs(_config('name: "resnet" backend: "ge"'), onnx)


def test_a_ge_style_config_compiles_with_the_stand_in_atc_and_serves_the_om_it_writes(tmp_path: Path) -> None:
    onnx = _relu(tmp_path / "resnet", ["N", 3, 224, 224])
    atc = fake_atc.install(tmp_path / "bin")
    tools = compiler.Toolchain(str(atc), "Ascend310P3", "8.0.RC1", tmp_path / "cache")
    config = _config(GE_STYLE)
    compiled = compiler.compile_version(config, onnx, onnx.parent.parent, tools)
    assert "--input_shape=input:1,3,224,224" in compiled.argv
    om = read_description(compiled.om)
    assert [list(t.dims) for t in om.inputs] == [[1, 3, 224, 224]]
    # The ACL backend's completion of the served config (the one in config.pbtxt) from that .om.
    completion.complete(config, om, True, str(compiled.om))
    assert config.max_batch_size == 1 and list(config.input[0].dims) == [3, 224, 224]


def test_the_stand_in_atc_refuses_an_input_shape_of_another_rank_as_atcs_onnx_parser_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    onnx = _relu(tmp_path, ["N", 3, 224, 224])
    base = ["--framework=5", f"--model={onnx}", f"--output={tmp_path / 'o'}", "--soc_version=Ascend310P3"]
    assert fake_atc.main([*base, "--input_shape=input:3,224,224"]) == 1
    assert (
        "E10001: Value [3,224,224] for parameter [--input_shape] is invalid. Reason: the rank of input 'input' "
        "given by --input_shape (3) does not match the model's (4)"
    ) in capsys.readouterr().out
    assert not (tmp_path / "o.om").exists()
    assert fake_atc.main([*base, "--input_shape=input:1,3,224,224"]) == 0


def test_the_stand_in_atc_fails_a_fixed_dim_given_another_value_where_the_graphs_shapes_disagree(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "project",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])],
        [numpy_helper.from_array(np.ones((4, 2), dtype=np.float32), "w")],
    )
    onnx = tmp_path / "project.onnx"
    onnx.write_bytes(onnx_bytes(graph))
    base = ["--framework=5", f"--model={onnx}", f"--output={tmp_path / 'o'}", "--soc_version=Ascend310P3"]
    assert fake_atc.main([*base, "--input_shape=x:1,5"]) == 1
    out = capsys.readouterr().out
    assert "E19999: Inner Error! infer shape failed with the shapes --input_shape gives" in out and "MatMul" in out


def _repository(root: Path, config: str, shape: list[int | str]) -> Path:
    folder = root / "models" / "resnet"
    _relu(folder, shape)
    (folder / "config.pbtxt").write_text(config)
    return folder


def test_check_warns_of_an_inferred_batch_dim_and_reports_a_rank_atc_refuses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _repository(tmp_path / "ge", GE_STYLE, ["N", 3, 224, 224])
    assert main(["check", "--model-repository", str(folder.parent)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(
        f"{folder / 'config.pbtxt'}: input: warning: model 'resnet': config input 'input' has dims [3, 224, 224] and "
        "no max_batch_size, one dim short of input 'input'"
    )
    assert "ATC compiles it as --input_shape=input:1,3,224,224" in out[0]
    assert out[1:] == ["1 model(s) checked: no problems, 1 warning(s)"]
    short = GE_STYLE.replace("dims: [ 3, 224, 224 ] } ]\noutput", "dims: [ 224, 224 ] } ]\noutput")
    folder = _repository(tmp_path / "short", short, ["N", 3, 224, 224])
    assert main(["check", "--model-repository", str(folder.parent)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out == [
        f"{folder / 'config.pbtxt'}: input: compiling '{folder / '1' / 'model.onnx'}' with ATC: model 'resnet': "
        "config input 'input' gives ATC --input_shape=input:224,224 (dims [224, 224]), 2 dims, but input 'input' of "
        f"'{folder / '1' / 'model.onnx'}' has shape [-1, 3, 224, 224], 4 dims; ATC refuses an input shape whose rank "
        "is not the graph's",
        "1 problem(s) in 1 model(s)",
    ]
