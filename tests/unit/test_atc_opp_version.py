"""The operator package's version is part of the compile cache key: its kernels change what ATC writes."""

from __future__ import annotations

from pathlib import Path

from geserve.atc import cache, host
from geserve.atc.command import AtcCommand
from tests.fakes.om_models import affine_onnx


def test_the_opp_version_is_read_where_its_installer_records_it(tmp_path: Path) -> None:
    opp = tmp_path / "latest" / "opp"
    opp.mkdir(parents=True)
    (opp / "version.info").write_text("Version=8.0.0.alpha003\nversion_dir=8.0.0\n")
    assert host.opp_version({"ASCEND_OPP_PATH": str(opp)}) == "8.0.0.alpha003"
    assert host.opp_version({"ASCEND_HOME_PATH": str(tmp_path / "latest")}) == "8.0.0.alpha003"
    assert host.opp_version({}) == ""


def test_an_operator_package_upgrade_recompiles(tmp_path: Path) -> None:
    onnx = tmp_path / "model.onnx"
    onnx.write_bytes(affine_onnx())
    command = AtcCommand(("--input_shape=x:-1,4",), ())
    first = cache.key(onnx, command, "Ascend310P3", "8.0.RC1", "8.0.0.alpha003")
    assert cache.key(onnx, command, "Ascend310P3", "8.0.RC1", "8.0.0.alpha003") == first
    assert cache.key(onnx, command, "Ascend310P3", "8.0.RC1", "8.0.0.alpha005") != first
