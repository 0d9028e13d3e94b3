"""The ATC command docs/ascend.md prints for its example config is the one geserve logs for it."""

from __future__ import annotations

import logging
import re
import shlex
from pathlib import Path

import onnx
import pytest
from google.protobuf import text_format
from onnx import TensorProto, helper

from geserve._generated import model_config_pb2 as mc
from geserve.atc import compiler
from tests.fakes import atc as fake_atc
from tests.support import ROOT

PAGE = ROOT / "docs" / "ascend.md"


def _blocks() -> list[str]:
    return re.findall(r"```[a-z]*\n(.*?)```", PAGE.read_text(), re.S)


def _resnet_shaped_onnx(path: Path) -> None:
    """The example's interface: input [N,3,224,224] -> output [N,1000], with as little graph as that takes."""
    weight = helper.make_tensor("w", TensorProto.FLOAT, [3, 1000], [0.0] * 3000)
    graph = helper.make_graph(
        [
            helper.make_node("ReduceMean", ["input"], ["pooled"], axes=[2, 3], keepdims=0),
            helper.make_node("MatMul", ["pooled", "w"], ["output"]),
        ],
        "resnet50_shaped",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 224, 224])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["N", 1000])],
        [weight],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)


def test_the_printed_command_is_the_logged_one(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config_text = next(block for block in _blocks() if 'name: "resnet50"' in block and 'backend: "ge"' in block)
    config = text_format.Parse(config_text, mc.ModelConfig())
    printed = next(block for block in _blocks() if "--framework=5" in block and "<repo>" in block)
    repository, cache = tmp_path / "repo", tmp_path / "cache"
    (repository / "resnet50" / "1").mkdir(parents=True)
    onnx_file = repository / "resnet50" / "1" / "model.onnx"
    _resnet_shaped_onnx(onnx_file)
    atc = fake_atc.install(tmp_path / "bin")
    tools = compiler.Toolchain(str(atc), "Ascend310P3", "8.0.RC1", cache)
    with caplog.at_level(logging.INFO, logger="geserve.atc.compiler"):
        compiler.compile_version(config, onnx_file, repository / "resnet50", tools)
    [logged] = [r.getMessage() for r in caplog.records if "with ATC: " in r.getMessage()]
    argv = shlex.split(logged.split("with ATC: ", 1)[1])
    placeholders = [
        (str(atc), "<atc>"),
        (str(repository), "<repo>"),
        (str(cache), "<cache>"),
        ("Ascend310P3", "<this host's chip>"),
    ]
    shown = []
    for token in argv:
        text = token
        for actual, placeholder in placeholders:
            text = text.replace(actual, placeholder)
        shown.append(re.sub(r"\.compiling-[^/]+", ".compiling-<id>", text))
    # The page's placeholders hold spaces and a quote (`<this host's chip>`): compared word by word.
    assert " ".join(shown).split() == printed.replace("\\\n", " ").split(), shown
