"""`--npu=auto` falls back to ONNX Runtime only on a host without the Ascend driver; a broken NPU setup fails the load."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from google.protobuf import text_format

from geserve._generated import model_config_pb2 as mc
from geserve.atc import compiler, host
from geserve.backends import registry
from geserve.errors import ModelLoadError
from geserve.repository.scan import ModelSource
from geserve.settings import WorkerSettings
from geserve.workers.npu_mode import FALLBACK_PARAMETER, NpuResolver, Resolved
from tests.fakes import atc as fake_atc
from tests.fakes.om_models import affine_onnx

CONFIG = """
name: "affine" backend: "ge" max_batch_size: 16
input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]
instance_group [ { kind: KIND_GPU gpus: [ 0 ] } ]
"""


def _resolve(tmp_path: Path, driver: str | None, *, mode: str = "auto", device_ids: tuple[int, ...] = ()) -> Resolved:
    folder = tmp_path / "affine"
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "1" / "model.onnx").write_bytes(affine_onnx())
    config = text_format.Parse(CONFIG, mc.ModelConfig())
    settings = WorkerSettings(npu_mode=mode, device_ids=device_ids, model_cache_dir=tmp_path / "cache")
    resolver = NpuResolver(settings, probe_driver=lambda: driver)
    return resolver.resolve(ModelSource("affine", folder), config, registry.by_name("ge"), 1)


def test_a_host_without_the_ascend_driver_serves_model_onnx_on_the_cpu(tmp_path: Path) -> None:
    resolved = _resolve(tmp_path, driver=None)
    assert resolved.backend.name == "onnxruntime"
    assert "this host has no NPU (no /dev/davinci* device and no Ascend driver)" in (
        resolved.config.parameters[FALLBACK_PARAMETER].string_value
    )


def test_npus_without_pyacl_fail_the_load_naming_set_env_instead_of_falling_back(tmp_path: Path) -> None:
    assert not host.has_pyacl()  # the simulator is not on this process's path
    with pytest.raises(ModelLoadError) as raised:
        _resolve(tmp_path, driver="/dev/davinci0", device_ids=(0,))
    message = raised.value.message
    assert "this host has NPUs (/dev/davinci0) but pyACL cannot be imported" in message
    assert "/usr/local/Ascend/cann/set_env.sh" in message and "ascend-toolkit/set_env.sh" in message
    assert "--npu=off serves model.onnx with ONNX Runtime" in message
    # Told there are NPUs (--device-ids), the same, with no driver to be seen.
    with pytest.raises(ModelLoadError, match=r"this host has NPUs \(--device-ids 0,1\) but pyACL"):
        _resolve(tmp_path, driver=None, device_ids=(0, 1))


def test_a_pod_given_no_npu_on_a_node_with_the_driver_fails_the_load(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"the Ascend driver is here \(/usr/local/Ascend/driver\) but this server"):
        _resolve(tmp_path, driver="/usr/local/Ascend/driver")


def test_npus_without_atc_fail_a_version_that_needs_compiling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host, "has_pyacl", lambda: True)
    monkeypatch.setattr(host, "find_atc", lambda: None)
    with pytest.raises(ModelLoadError) as raised:
        _resolve(tmp_path, driver="/dev/davinci0", device_ids=(0,))
    message = raised.value.message
    assert "CANN's atc is not on PATH to compile it" in message and "--npu=off" in message
    with pytest.raises(ModelLoadError, match=r"--npu=required, but the version folder holds model\.onnx and no \.om"):
        _resolve(tmp_path, driver="/dev/davinci0", device_ids=(0,), mode="required")


def test_the_driver_is_seen_by_its_device_files_or_its_install_folder(tmp_path: Path) -> None:
    dev, driver = tmp_path / "dev", tmp_path / "driver"
    dev.mkdir()
    (dev / "null").touch()
    assert host.ascend_driver(dev, driver) is None
    driver.mkdir()
    assert host.ascend_driver(dev, driver) == str(driver)
    (dev / "davinci_manager").touch()
    (dev / "davinci3").touch()
    assert host.ascend_driver(dev, driver) == f"{dev}/davinci3, {dev}/davinci_manager"


def test_an_image_without_atc_serves_a_compile_cached_for_a_sibling_chip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`geserve compile --soc-version Ascend310P1` at image build time; a 310P3 host without atc serves that `.om`
    (the runtime loads it on any chip of the architecture) instead of failing; a 910B3 host does not."""
    folder = tmp_path / "affine"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.onnx").write_bytes(affine_onnx())
    config = text_format.Parse(CONFIG, mc.ModelConfig())
    atc = fake_atc.install(tmp_path / "bin")
    built = compiler.compile_version(
        config,
        folder / "1" / "model.onnx",
        folder,
        compiler.Toolchain(str(atc), "Ascend310P1", "8.0", tmp_path / "cache"),
    )
    monkeypatch.setattr(host, "has_pyacl", lambda: True)
    monkeypatch.setattr(host, "find_atc", lambda: None)
    monkeypatch.setattr(host, "cann_version", lambda **_: "8.0")
    monkeypatch.setattr(host, "opp_version", lambda **_: "")
    for chip, served in (("Ascend310P3", True), ("Ascend910B3", False)):
        monkeypatch.setattr(host, "soc_name", lambda chip=chip: chip)
        settings = WorkerSettings(device_ids=(0,), model_cache_dir=tmp_path / "cache")
        resolver = NpuResolver(settings, probe_driver=lambda: "/dev/davinci0")
        if served:
            with caplog.at_level(logging.WARNING, logger="geserve.atc.compiler"):
                resolved = resolver.resolve(ModelSource("affine", folder), config, registry.by_name("ge"), 1)
            assert resolved.model_path == built.om and resolved.backend.name == "ge"
            assert "serving the one made for Ascend310P1, a chip of the same architecture" in caplog.text
        else:
            with pytest.raises(ModelLoadError, match="CANN's atc is not on PATH"):
                resolver.resolve(ModelSource("affine", folder), config, registry.by_name("ge"), 1)
