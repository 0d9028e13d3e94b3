"""Which backend a config selects, and where the model file of a version is."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import text_format

from geserve._generated import model_config_pb2 as mc
from geserve.backends import registry
from geserve.core.loader import model_file_path
from geserve.errors import ModelLoadError
from geserve.repository.scan import ModelSource


@pytest.mark.parametrize(
    ("backend", "platform", "expected"),
    [("ge", "", "ge"), ("acl", "", "ge"), ("", "ge", "ge"), ("", "onnxruntime_onnx", "onnxruntime")],
)
def test_backend_names_aliases_and_platforms(backend: str, platform: str, expected: str) -> None:
    assert registry.resolve(backend, platform, [], "").name == expected


def test_an_om_file_selects_the_ascend_backend(tmp_path: Path) -> None:
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "model.om").write_bytes(b"")
    assert registry.resolve("", "", [tmp_path / "1"], "").name == "ge"


def _config(text: str) -> mc.ModelConfig:
    return text_format.Parse(f'name: "m" {text}', mc.ModelConfig())


def test_model_path_parameter_is_relative_to_the_model_folder(tmp_path: Path) -> None:
    source = ModelSource("m", tmp_path / "m")
    spec = registry.by_name("ge")
    config = _config('parameters { key: "model_path" value { string_value: "compiled/net.om" } }')
    assert model_file_path(source, config, spec, 1) == (tmp_path / "m" / "compiled" / "net.om").resolve()
    config.default_model_filename = "model.om"
    del config.parameters["model_path"]
    assert model_file_path(source, config, spec, 3) == tmp_path / "m" / "3" / "model.om"


@pytest.mark.parametrize("value", ["../other/model.om", "/etc/passwd", "1/../../x.om"])
def test_model_path_outside_the_model_folder_is_refused(tmp_path: Path, value: str) -> None:
    config = _config(f'parameters {{ key: "model_path" value {{ string_value: "{value}" }} }}')
    with pytest.raises(ModelLoadError, match="must name a file inside the model's folder"):
        model_file_path(ModelSource("m", tmp_path / "m"), config, registry.by_name("ge"), 1)
