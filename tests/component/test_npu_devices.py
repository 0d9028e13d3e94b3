"""NPU numbering: logical ids for set_device, whatever /dev/davinciN numbers a container was given."""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from geserve.backends import registry
from geserve.errors import ModelLoadError
from geserve.repository.config import parse_config_text
from geserve.repository.scan import ModelSource
from geserve.residency import SharedTensor
from geserve.settings import WorkerSettings
from geserve.workers.batch import Batch
from geserve.workers.devices import discover_devices, worker_visible_devices
from geserve.workers.messages import RequestInfo
from geserve.workers.placement import instance_specs
from geserve.workers.process import ProcessWorker
from tests.fakes.om_models import FEATURES, affine_reference, write_affine_om

FAKES = Path(__file__).resolve().parents[1] / "fakes"
CONFIG = """
name: "affine"
backend: "ge"
instance_group [ { kind: KIND_GPU count: 1 } ]
"""


def _fake_dev(root: Path, *names: str) -> Path:
    dev = root / "dev"
    dev.mkdir()
    for name in names:
        (dev / name).touch()
    return dev


def test_a_container_given_davinci3_and_davinci5_has_logical_devices_0_and_1(tmp_path: Path) -> None:
    dev = _fake_dev(tmp_path, "davinci3", "davinci5", "davinci_manager", "devmm_svm", "hisi_hdc")
    assert discover_devices(dev, environ={}) == (0, 1)
    assert [worker_visible_devices(device, environ={}) for device in (0, 1)] == ["0", "1"]


def test_visible_devices_set_for_the_server_are_logical_ids_and_pass_through_to_workers(tmp_path: Path) -> None:
    dev = _fake_dev(tmp_path, "davinci0", "davinci1", "davinci2")
    environ = {"ASCEND_RT_VISIBLE_DEVICES": "4,6"}
    assert discover_devices(dev, environ=environ) == (0, 1)
    assert [worker_visible_devices(device, environ=environ) for device in (0, 1)] == ["4", "6"]
    # parsing stops at the first id that is not a number, as the runtime's does
    assert discover_devices(dev, environ={"ASCEND_RT_VISIBLE_DEVICES": "2,x,3"}) == (0,)


def test_spaces_and_unordered_ids_stop_the_list_as_in_the_runtime_and_are_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """CANN's envref_07_0028: in '1, 2,3' the space before 2 stops the list at 1; ids go in ascending order."""
    dev = _fake_dev(tmp_path, "davinci0", "davinci1", "davinci2")
    assert discover_devices(dev, environ={"ASCEND_RT_VISIBLE_DEVICES": "0, 1"}) == (0,)
    assert "reads only the ids before ' 1'" in caplog.text and "NPUs visible are ['0']" in caplog.text
    assert worker_visible_devices(1, environ={"ASCEND_RT_VISIBLE_DEVICES": "4, 6"}) == "1"  # no '6' for NPU 1
    caplog.clear()
    assert discover_devices(dev, environ={"ASCEND_RT_VISIBLE_DEVICES": "0,2"}) == (0, 1)
    assert "ASCEND_RT_VISIBLE_DEVICES" not in caplog.text


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("1,0", "an id is lower than the one before it ('0' after '1')"),
        ("0,0", "an id is listed twice ('0')"),
    ],
)
def test_a_descending_or_repeated_id_hides_every_npu_and_is_warned_about(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, value: str, why: str
) -> None:
    """runtime.cc Runtime::GetVisibleDevices refuses such a list whole: the runtime then sees no device at all."""
    dev = _fake_dev(tmp_path, "davinci0", "davinci1")
    assert discover_devices(dev, environ={"ASCEND_RT_VISIBLE_DEVICES": value}) == ()
    assert caplog.messages == [
        f"ASCEND_RT_VISIBLE_DEVICES='{value}' hides every NPU: the Ascend runtime refuses the whole list when {why}, "
        "and then sees no device; list each id once, in ascending order (e.g. '0,1')"
    ]
    monkeypatch.syspath_prepend(str(FAKES))  # and the runtime (the simulator) counts none
    assert discover_devices(dev, environ={"ACL_SIM_DEVICE_COUNT": "2", "ASCEND_RT_VISIBLE_DEVICES": value}) == ()


def test_with_pyacl_the_runtime_counts_the_devices_in_a_probe_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three NPUs for the runtime, one /dev/davinciN file (a driver that maps devices otherwise): the runtime wins;
    and ACL is initialised in the probe, not in this process."""
    monkeypatch.syspath_prepend(str(FAKES))
    reports = tmp_path / "reports"
    reports.mkdir()
    dev = _fake_dev(tmp_path, "davinci7")
    environ = {"ACL_SIM_DEVICE_COUNT": "3", "ACL_SIM_REPORT_DIR": str(reports)}
    assert discover_devices(dev, environ=environ) == (0, 1, 2)
    (probe,) = _reports(reports)
    assert probe["pid"] != os.getpid()
    assert probe["calls"] == {"init": 1, "rt.get_device_count": 1, "finalize": 1}
    assert probe["leaks"] == [] and probe["finalized"]
    # ASCEND_RT_VISIBLE_DEVICES as the runtime reads it: '0, 2' leaves device 0 alone
    assert discover_devices(dev, environ={**environ, "ASCEND_RT_VISIBLE_DEVICES": "0, 2"}) == (0,)
    assert discover_devices(dev, environ={**environ, "ASCEND_RT_VISIBLE_DEVICES": "1,2"}) == (0, 1)


def test_a_probe_that_does_not_answer_falls_back_to_the_device_files_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.syspath_prepend(str(FAKES))
    dev = _fake_dev(tmp_path, "davinci3", "davinci5")
    environ = {"ACL_SIM_DEVICE_COUNT": "4", "ACL_SIM_INIT_DELAY_MS": "20000"}
    started = time.monotonic()
    assert discover_devices(dev, environ=environ, probe_timeout_s=1) == (0, 1)
    assert time.monotonic() - started < 10
    assert "could not count NPUs with pyACL (acl.rt.get_device_count)" in caplog.text
    assert "did not answer within 1 s" in caplog.text and f"the davinci chips in {dev}" in caplog.text


def test_a_cpu_instance_group_of_a_ge_model_is_refused_naming_the_field(tmp_path: Path) -> None:
    model_dir = tmp_path / "models" / "affine"
    write_affine_om(model_dir / "1" / "model.om", gears=[1, 2, 4])
    config = parse_config_text(CONFIG.replace("KIND_GPU", "KIND_CPU"), "affine")
    config.default_model_filename = "model.om"
    source = ModelSource("affine", model_dir)
    with pytest.raises(ModelLoadError) as error:
        instance_specs(source, config, _ge_backend(), 1, WorkerSettings(device_ids=(0, 1)))
    assert error.value.message == (
        "model 'affine': instance_group[0] has kind KIND_CPU, but the 'ge' backend runs .om models on "
        "Ascend NPUs only: use KIND_GPU (the NPUs, chosen by 'gpus') or KIND_AUTO; a config migrated from Triton: "
        "change kind to KIND_GPU or KIND_AUTO, or drop instance_group (one instance per NPU); to serve it on the "
        'CPU instead, set backend: "onnxruntime" (it runs model.onnx)'
    )
    # without NPUs KIND_AUTO is filled in as KIND_CPU: the message says so
    with pytest.raises(ModelLoadError, match=r"this server has no NPUs .* so KIND_AUTO means KIND_CPU here"):
        instance_specs(source, config, _ge_backend(), 1, WorkerSettings(device_ids=()))
    # other backends keep their CPU instances
    python = parse_config_text('name: "affine"\ninstance_group [ { kind: KIND_CPU count: 2 } ]', "affine")
    specs = instance_specs(source, python, registry.by_name("python"), 1, WorkerSettings(device_ids=(0, 1)))
    assert [(spec.kind, spec.on_device) for spec in specs] == [("CPU", False), ("CPU", False)]


async def test_a_worker_given_a_list_the_runtime_cuts_short_opens_the_one_device_it_sees(
    tmp_path: Path, simulated_container: Path
) -> None:
    """'1, 0' shows the runtime device 1 alone (the space stops the list), as its device 0: the backend counts
    the visible devices as the runtime does, so it opens device 0 rather than the logical id it was given."""
    model_dir = tmp_path / "models" / "affine"
    write_affine_om(model_dir / "1" / "model.om", gears=[1, 2, 4])
    config = parse_config_text(CONFIG, "affine")
    config.default_model_filename = "model.om"
    settings = WorkerSettings(device_ids=(0, 1))
    spec = instance_specs(ModelSource("affine", model_dir), config, _ge_backend(), 1, settings)[1]
    worker = ProcessWorker(replace(spec, environment=(("ASCEND_RT_VISIBLE_DEVICES", "1, 0"),)))
    try:
        await worker.start()
        x = np.ones((1, FEATURES), dtype=np.float32)
        executed = await worker.execute(Batch({"x": [SharedTensor.local(x)]}, ("y",), [RequestInfo(1, ("y",))]))
        (outputs,) = executed.results
        assert isinstance(outputs, dict)
        np.testing.assert_array_equal(outputs["y"].array, affine_reference(x)["y"])
    finally:
        await worker.stop(timeout_s=10)
    (report,) = _reports(simulated_container)
    assert report["device_count"] == 1 and report["executions"] == 1


@pytest.fixture
def simulated_container(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Worker processes import the pyACL simulator; the runtime sees the container's two chips."""
    monkeypatch.syspath_prepend(str(FAKES))  # spawned workers start with this process's sys.path
    monkeypatch.setenv("ACL_SIM_DEVICE_COUNT", "2")
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    reports = tmp_path / "reports"
    reports.mkdir()
    monkeypatch.setenv("ACL_SIM_REPORT_DIR", str(reports))
    return reports


async def test_both_devices_get_a_worker_and_each_worker_sees_exactly_one(
    tmp_path: Path, simulated_container: Path
) -> None:
    dev = _fake_dev(tmp_path, "davinci3", "davinci5", "davinci_manager")
    model_dir = tmp_path / "models" / "affine"
    write_affine_om(model_dir / "1" / "model.om", gears=[1, 2, 4])
    config = parse_config_text(CONFIG, "affine")
    config.default_model_filename = "model.om"
    settings = WorkerSettings(device_ids=discover_devices(dev, environ={}))
    specs = instance_specs(ModelSource("affine", model_dir), config, _ge_backend(), 1, settings)
    assert [(s.device_id, dict(s.environment)["ASCEND_RT_VISIBLE_DEVICES"]) for s in specs] == [(0, "0"), (1, "1")]
    workers = [ProcessWorker(spec) for spec in specs]
    try:
        for worker in workers:
            await worker.start()
        x = np.arange(2 * FEATURES, dtype=np.float32).reshape(2, FEATURES)
        for worker in workers:
            executed = await worker.execute(Batch({"x": [SharedTensor.local(x)]}, ("y",), [RequestInfo(2, ("y",))]))
            (outputs,) = executed.results
            assert isinstance(outputs, dict)
            np.testing.assert_array_equal(outputs["y"].array, affine_reference(x)["y"])
    finally:
        for worker in workers:
            await worker.stop(timeout_s=10)
    reports = _reports(simulated_container)
    assert sorted(report["visible_devices"] for report in reports) == ["0", "1"]
    assert all(report["device_count"] == 1 and report["executions"] == 1 for report in reports), reports


async def test_a_physical_chip_id_in_visible_devices_hides_the_chip(tmp_path: Path, simulated_container: Path) -> None:
    """What numbering workers by /dev/davinci5 did: ASCEND_RT_VISIBLE_DEVICES=5 names no device of two."""
    model_dir = tmp_path / "models" / "affine"
    write_affine_om(model_dir / "1" / "model.om", gears=[1, 2, 4])
    config = parse_config_text(CONFIG, "affine")
    config.default_model_filename = "model.om"
    spec = instance_specs(ModelSource("affine", model_dir), config, _ge_backend(), 1, WorkerSettings(device_ids=(0,)))[
        0
    ]
    worker = ProcessWorker(replace(spec, environment=(("ASCEND_RT_VISIBLE_DEVICES", "5"),)))
    with pytest.raises(ModelLoadError, match=r"acl.rt.set_device failed with error 107001"):
        await worker.start()
    await worker.stop(timeout_s=10)


def _reports(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(path.read_text()) for path in folder.glob("acl-sim-*.json")]


def _ge_backend() -> registry.BackendSpec:
    return registry.by_name("ge")
