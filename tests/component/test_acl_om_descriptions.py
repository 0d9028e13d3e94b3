"""What the pyACL simulator says of `.om` files: the samples' expected.json and the writer's record, never
geserve's reader; GE's `_dynamic_output_dims` behind get_cur_output_dims; the 128-byte dims name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from geserve.backends.acl import om_file, om_graph, om_records
from tests.fakes.om_models import resnet50_description
from tests.fakes.om_writer import write_om
from tests.support import ROOT

SAMPLES = ROOT / "tests" / "data" / "om-samples"
EXPECTED: dict[str, Any] = json.loads((SAMPLES / "expected.json").read_text())
FAILURE = 500001  # ACL_ERROR_FAILURE
TYPE_NAMES = {0: "float32", 1: "float16", 3: "int32", 4: "uint8", 9: "int64"}
FORMAT_NAMES = {0: "NCHW", 1: "NHWC", 2: "ND"}


def _no_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any use of geserve's offline reader fails the test."""

    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("the simulator used geserve's offline reader")

    for module, name in (
        (om_file, "read_description"),
        (om_file, "describe_bytes"),
        (om_file, "_describe"),
        (om_graph, "parse_model_def"),
        (om_records, "parse_inout_info"),
    ):
        monkeypatch.setattr(module, name, refuse)


def _open(acl: Any, path: Path) -> tuple[int, int]:
    acl.init()
    acl.rt.set_device(0)
    acl.rt.create_context(0)
    model_id, ret = acl.mdl.load_from_file(str(path))
    assert ret == 0, acl.get_recent_err_msg()
    desc = acl.mdl.create_desc()
    assert acl.mdl.get_desc(desc, model_id) == 0
    return model_id, desc


def _described(acl: Any, desc: int) -> dict[str, Any]:
    """The description pyACL gives, in expected.json's terms."""
    mdl = acl.mdl

    def tensor(side: str, index: int) -> dict[str, Any]:
        dims = getattr(mdl, f"get_{side}_dims")(desc, index)[0]["dims"]
        return {
            "name": getattr(mdl, f"get_{side}_name_by_index")(desc, index),
            "dtype": TYPE_NAMES[getattr(mdl, f"get_{side}_data_type")(desc, index)],
            "dims": dims,
            "format": FORMAT_NAMES[getattr(mdl, f"get_{side}_format")(desc, index)],
        }

    batch = mdl.get_dynamic_batch(desc)[0]
    return {
        "inputs": [tensor("input", i) for i in range(mdl.get_num_inputs(desc))],
        "outputs": [tensor("output", i) for i in range(mdl.get_num_outputs(desc))],
        "gears": batch["batch"][: batch["batchCount"]],
    }


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_sample_is_described_from_expected_json_without_the_reader(
    acl: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str
) -> None:
    _no_reader(monkeypatch)
    path = tmp_path / "model.om"  # a copy, as a model repository holds it
    path.write_bytes((SAMPLES / name).read_bytes())
    expected = EXPECTED[name]
    if "error" in expected:
        acl.init()
        acl.rt.set_device(0)
        acl.rt.create_context(0)
        assert acl.mdl.load_from_file(str(path)) == (0, 100012)  # ACL_ERROR_DESERIALIZE_MODEL
        assert expected["error"] in acl.get_recent_err_msg()
        return
    _, desc = _open(acl, path)
    assert _described(acl, desc) == {
        "inputs": expected["inputs"],
        "outputs": expected["outputs"],
        "gears": (expected["dynamic"] or {}).get("dynamic_batch", []),
    }


def test_a_written_file_is_described_from_the_writers_record_without_the_reader(
    acl: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _no_reader(monkeypatch)
    description = resnet50_description([1, 4, 2])
    _, desc = _open(acl, write_om(tmp_path / "model.om", description))
    assert _described(acl, desc) == {
        "inputs": description["inputs"],
        "outputs": description["outputs"],
        "gears": [1, 4, 2],  # in the file's order, as the Case op holds them
    }


def test_a_file_the_simulator_does_not_know_fails_to_load(acl: Any, tmp_path: Path) -> None:
    path = tmp_path / "model.om"
    data = bytearray((SAMPLES / "ddnet_out.om").read_bytes())
    data[-1] ^= 0xFF  # no longer the sample, and no writer's record
    path.write_bytes(bytes(data))
    acl.init()
    acl.rt.set_device(0)
    acl.rt.create_context(0)
    assert acl.mdl.load_from_file(str(path)) == (0, 100012)
    assert "not a model the simulator knows" in acl.get_recent_err_msg()


def _set_gear(acl: Any, model_id: int, desc: int, batch: int) -> None:
    index, _ = acl.mdl.get_input_index_by_name(desc, "ascend_mbatch_shape_data")
    dataset = acl.mdl.create_dataset()
    for i in range(acl.mdl.get_num_inputs(desc)):
        size = max(acl.mdl.get_input_size_by_index(desc, i), 1)
        address, _ = acl.rt.malloc(size, 2)
        acl.mdl.add_dataset_buffer(dataset, acl.create_data_buffer(address, size))
    assert acl.mdl.set_dynamic_batch_size(model_id, dataset, index, batch) == 0


def test_cur_output_dims_come_from_the_files_dynamic_output_dims(acl: Any, tmp_path: Path) -> None:
    """Whatever `_dynamic_output_dims` says for the gear set is what get_cur_output_dims answers."""
    description = resnet50_description([1, 2, 4])
    path = write_om(tmp_path / "model.om", description, dynamic_output_dims=["0,0,1,1000", "1,0,2,7", "2,0,4,1000"])
    model_id, desc = _open(acl, path)
    assert acl.mdl.get_cur_output_dims(desc, 0)[0]["dims"] == [4, 1000]  # no gear set: the largest
    _set_gear(acl, model_id, desc, 2)
    assert acl.mdl.get_cur_output_dims(desc, 0) == ({"name": "Gemm_174:0:output", "dimCount": 2, "dims": [2, 7]}, 0)
    _set_gear(acl, model_id, desc, 4)
    assert acl.mdl.get_cur_output_dims(desc, 0)[0]["dims"] == [4, 1000]


def test_written_gear_files_carry_ges_dynamic_output_dims(acl: Any, tmp_path: Path) -> None:
    model_id, desc = _open(acl, write_om(tmp_path / "model.om", resnet50_description([1, 2, 4, 8])))
    for gear in (1, 2, 4, 8):
        _set_gear(acl, model_id, desc, gear)
        assert acl.mdl.get_cur_output_dims(desc, 0)[0]["dims"] == [gear, 1000]


def test_a_gear_file_without_dynamic_output_dims_cannot_give_cur_output_dims_once_a_gear_is_set(
    acl: Any, tmp_path: Path
) -> None:
    """As the runtime: GetCurOuputShapeInfo finds no entry and aclmdlGetCurOutputDims fails."""
    path = write_om(tmp_path / "model.om", resnet50_description([1, 2, 4, 8]), dynamic_output_dims=None)
    model_id, desc = _open(acl, path)
    assert acl.mdl.get_cur_output_dims(desc, 0)[0]["dims"] == [8, 1000]
    _set_gear(acl, model_id, desc, 2)
    assert acl.mdl.get_cur_output_dims(desc, 0) == ({}, FAILURE)
    assert "no entry for output 0 at gear index 1" in acl.get_recent_err_msg()


def test_the_synthetic_samples_dynamic_output_dims_name_no_output_0(acl: Any, tmp_path: Path) -> None:
    """synthetic_dynbatch.om's NetOutput carries "0,1,1000" ... "3,8,1000": read as GE reads them
    (gear, output, dims) they describe outputs 1, 2, 4 and 8, so the runtime has no dims for output 0."""
    path = tmp_path / "model.om"
    path.write_bytes((SAMPLES / "synthetic_dynbatch.om").read_bytes())
    model_id, desc = _open(acl, path)
    assert acl.mdl.get_cur_output_dims(desc, 0)[0]["dims"] == [8, 1000]
    _set_gear(acl, model_id, desc, 1)
    assert acl.mdl.get_cur_output_dims(desc, 0) == ({}, FAILURE)


def test_names_too_long_for_the_dims_struct_are_given_there_by_index(acl: Any, tmp_path: Path) -> None:
    long_name = "PartitionedCall_/" + "block/" * 20 + "Conv_9:0:logits"
    description = resnet50_description([1, 2])
    description["outputs"][0]["name"] = long_name
    model_id, desc = _open(acl, write_om(tmp_path / "model.om", description))
    assert len(long_name) >= 128
    assert acl.mdl.get_output_name_by_index(desc, 0) == long_name  # the real name
    assert acl.mdl.get_output_dims(desc, 0)[0]["name"] == f"acl_modelId_{model_id}_output_0"
    assert acl.mdl.get_input_dims(desc, 0)[0]["name"] == "input"  # short names stay


def test_memcpy_ignores_the_kind_and_copies_by_the_pointers(acl: Any) -> None:
    """`kind` of synchronous aclrtMemcpy is reserved: the runtime infers the direction from the pointers."""
    acl.init()
    acl.rt.set_device(0)
    acl.rt.create_context(0)
    device, _ = acl.rt.malloc(64, 2)
    host = np.arange(16, dtype=np.int32)
    assert acl.rt.memcpy(device, 64, host.ctypes.data, 64, 2) == 0  # DEVICE_TO_HOST named, host-to-device done
    back = np.zeros(16, dtype=np.int32)
    assert acl.rt.memcpy(back.ctypes.data, 64, device, 64, 0) == 0  # HOST_TO_HOST named
    np.testing.assert_array_equal(back, host)
