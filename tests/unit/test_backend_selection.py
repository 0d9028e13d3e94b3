"""Which backend a config selects, and where the model file of a version is."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import text_format

from geserve._generated import model_config_pb2 as mc
from geserve.backends import base, registry
from geserve.errors import ModelLoadError
from geserve.repository.scan import ModelSource
from geserve.workers.placement import model_file_path


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


def _touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    return path


def _model_path(value: str) -> mc.ModelConfig:
    return _config(f'parameters {{ key: "model_path" value {{ string_value: "{value}" }} }}')


def test_model_path_parameter_is_looked_up_in_the_model_folder_first(tmp_path: Path) -> None:
    source = ModelSource("m", tmp_path / "m")
    spec = registry.by_name("ge")
    inside = _touch(tmp_path / "m" / "compiled" / "net.om")
    _touch(tmp_path / "compiled" / "net.om")  # the repository's file of the same name loses
    assert model_file_path(source, _model_path("compiled/net.om"), spec, 1) == inside.resolve()
    config = _model_path("compiled/net.om")
    config.default_model_filename = "model.om"
    del config.parameters["model_path"]
    assert model_file_path(source, config, spec, 3) == tmp_path / "m" / "3" / "model.om"


def test_model_path_parameter_relative_to_the_repository_as_the_ge_backend_writes_it(tmp_path: Path) -> None:
    om = _touch(tmp_path / "resnet50_v2" / "resnet50_v2.om")
    source = ModelSource("resnet50_v2", tmp_path / "resnet50_v2")
    path = model_file_path(source, _model_path("resnet50_v2/resnet50_v2.om"), registry.by_name("ge"), 1)
    assert path == om.resolve()


def test_a_missing_model_path_names_every_place_looked_and_the_om_files_found(tmp_path: Path) -> None:
    _touch(tmp_path / "m" / "1" / "model.om")
    _touch(tmp_path / "m" / "2" / "other.om")
    with pytest.raises(ModelLoadError) as error:
        model_file_path(ModelSource("m", tmp_path / "m"), _model_path("net.om"), registry.by_name("ge"), 1)
    message = error.value.message
    assert f"'{(tmp_path / 'm' / 'net.om').resolve()}' and '{(tmp_path / 'net.om').resolve()}'" in message
    assert "om files in the version folders: ['1/model.om', '2/other.om']" in message


@pytest.mark.parametrize("value", ["../../other/model.om", "/etc/passwd", "1/../../../x.om"])
def test_model_path_outside_the_repository_is_refused(tmp_path: Path, value: str) -> None:
    _touch(tmp_path / "repo" / "m" / "1" / "model.om")
    with pytest.raises(ModelLoadError, match="must name a file inside the model repository"):
        model_file_path(ModelSource("m", tmp_path / "repo" / "m"), _model_path(value), registry.by_name("ge"), 1)


def _methods(protocol: type) -> set[str]:
    return {name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")}


@pytest.mark.parametrize("spec", registry.BACKENDS, ids=lambda spec: spec.name)
def test_each_backend_declares_exactly_the_optional_protocols_it_implements(spec: registry.BackendSpec) -> None:
    """The registry's flags are what the worker trusts: a flag without the methods, or methods without the
    flag, would either fail at the first batch or leave a capability unused."""
    made = spec.create_typed()
    declared = {
        base.PipelinedBackend: made.pipelined,
        base.RequestBackend: made.per_request,
        base.DeviceReporter: made.device,
        base.ModelHost: made.model,
    }
    for protocol, typed in declared.items():
        implements = all(callable(getattr(made.backend, name, None)) for name in _methods(protocol))
        assert implements == (typed is not None), f"{spec.name}: {protocol.__name__}"
        assert typed is None or typed is made.backend
    assert all(callable(getattr(made.backend, name, None)) for name in _methods(base.Backend))
