"""The Ascend backend in this process against the pyACL simulator, and the simulator's own rules."""

from __future__ import annotations

import ctypes
import re
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from geserve._generated import model_config_pb2 as mc
from geserve.backends.acl import AclBackend
from geserve.backends.base import DeviceFaultError
from geserve.errors import InternalError, ModelLoadError
from tests.fakes.acl.om import twin_path
from tests.fakes.om_models import FEATURES, affine_description, affine_onnx, affine_reference, write_affine_om
from tests.fakes.om_writer import write_om

GEARS = [1, 2, 4, 8]


def _runtime() -> Any:
    from acl._state import RUNTIME

    return RUNTIME


def _loaded(path: Path, config: mc.ModelConfig | None = None, device: int = 0) -> tuple[AclBackend, mc.ModelConfig]:
    backend = AclBackend()
    config = config or mc.ModelConfig(name="affine")
    backend.load(config, path, device)
    backend.complete_config(config, auto_complete=True)
    return backend, config


class _Counting:
    """A thread that counts as fast as it can: how far it gets during a call tells whether the call let go
    of the GIL."""

    def __init__(self) -> None:
        self.ticks = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._count)

    def _count(self) -> None:
        while not self._stop.is_set():
            self.ticks += 1

    def during(self, call: Any) -> int:
        before = self.ticks
        call()
        return self.ticks - before

    def __enter__(self) -> _Counting:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def _rows(count: int) -> np.ndarray:
    return (np.arange(count * FEATURES, dtype=np.float32).reshape(count, FEATURES) - 7.5) / 3


@pytest.mark.usefixtures("acl")
@pytest.mark.parametrize("run_mode", ["1", "0"])
def test_every_gear_and_sizes_between_run_padded_to_the_next_gear(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run_mode: str
) -> None:
    monkeypatch.setenv("ACL_SIM_RUN_MODE", run_mode)  # 0: the app runs on the device's CPU (RC mode)
    backend, config = _loaded(write_affine_om(tmp_path / "model.om", gears=GEARS))
    assert config.max_batch_size == 8
    assert list(config.dynamic_batching.preferred_batch_size) == GEARS
    for rows in range(1, 9):
        x = _rows(rows)
        outputs = backend.execute({"x": x}, ["y", "s"])
        reference = affine_reference(x)
        np.testing.assert_array_equal(outputs["y"], reference["y"])
        np.testing.assert_array_equal(outputs["s"], reference["s"])
    assert _runtime().rows_executed == [1, 2, 4, 4, 8, 8, 8, 8]
    backend.execute({"x": _rows(3)}, ["y"])  # after a full batch: the padding row must not be stale data
    np.testing.assert_array_equal(_runtime().last_inputs["x"][3:], np.zeros((1, FEATURES), dtype=np.float32))
    backend.unload()
    assert _runtime().leaks() == []
    assert _runtime().finalized


@pytest.mark.usefixtures("acl")
def test_static_batch_model_is_padded_to_its_batch(tmp_path: Path) -> None:
    backend, config = _loaded(write_affine_om(tmp_path / "model.om", static_batch=4))
    assert config.max_batch_size == 4
    assert list(config.dynamic_batching.preferred_batch_size) == [4]
    for rows in (1, 3, 4):
        x = _rows(rows)
        np.testing.assert_array_equal(backend.execute({"x": x}, ["y"])["y"], affine_reference(x)["y"])
    assert _runtime().rows_executed == [4, 4, 4]
    backend.unload()
    assert _runtime().leaks() == []


@pytest.mark.usefixtures("acl")
def test_outputs_are_copied_straight_into_the_callers_memory(tmp_path: Path) -> None:
    backend, _ = _loaded(write_affine_om(tmp_path / "model.om", gears=GEARS))
    given: dict[str, np.ndarray] = {}

    def allocate(name: str, datatype: str, shape: tuple[int, ...]) -> np.ndarray:
        assert datatype == "FP32"
        given[name] = np.full(shape, np.nan, dtype=np.float32)
        return given[name]

    x = _rows(3)
    outputs = backend.execute({"x": x}, ["s"], allocate)
    assert outputs["s"] is given["s"] and outputs["s"].shape == (3, 1)
    np.testing.assert_array_equal(outputs["s"], affine_reference(x)["s"])
    backend.unload()


@pytest.mark.usefixtures("acl")
def test_config_that_contradicts_the_om_names_both(tmp_path: Path) -> None:
    path = write_affine_om(tmp_path / "model.om", gears=GEARS)
    cases = {
        "max_batch_size: 16": "config max_batch_size 16 exceeds what",
        'max_batch_size: 8 input { name: "x" data_type: TYPE_INT32 dims: [4] }': (
            "config input 'x' has data type TYPE_INT32, but"
        ),
        'max_batch_size: 8 input { name: "x" data_type: TYPE_FP32 dims: [5] }': "config input 'x' has dims [5], but",
        'max_batch_size: 8 input { name: "image" data_type: TYPE_FP32 dims: [4] }': "config input 'image' is not in",
    }
    from google.protobuf import text_format

    for text, message in cases.items():
        config = text_format.Parse(f'name: "affine" {text}', mc.ModelConfig())
        backend = AclBackend()
        backend.load(config, path, 0)
        with pytest.raises(ModelLoadError) as error:
            backend.complete_config(config, auto_complete=True)
        assert message in error.value.message and str(path) in error.value.message
        backend.unload()
        assert _runtime().leaks() == []


def test_without_pyacl_the_load_error_says_where_it_comes_from(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "acl", None)  # `import acl` raises ImportError
    backend = AclBackend()
    with pytest.raises(ModelLoadError) as error:
        backend.load(mc.ModelConfig(name="affine"), write_affine_om(tmp_path / "model.om", gears=GEARS), 0)
    assert "comes with the Ascend CANN toolkit" in error.value.message
    assert (
        "('source /usr/local/Ascend/cann/set_env.sh' for CANN 8.5 and newer, "
        "'source /usr/local/Ascend/ascend-toolkit/set_env.sh' before)"
    ) in error.value.message


@pytest.mark.usefixtures("acl")
def test_injected_device_fault_fails_the_batch_as_a_device_fault(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fault = tmp_path / "fault"
    monkeypatch.setenv("ACL_SIM_FAULT_FILE", str(fault))
    backend, _ = _loaded(write_affine_om(tmp_path / "model.om", gears=GEARS))
    fault.write_text("507011")
    with pytest.raises(DeviceFaultError) as error:
        backend.execute({"x": _rows(2)}, ["y"])
    # launched asynchronously: the runtime reports the fault when the stream is synchronized
    assert (
        "acl.rt.synchronize_stream_with_timeout failed with error 507011 (ACL_ERROR_RT_MODEL_EXECUTE)"
        in error.value.message
    )
    assert "injected fault 507011" in error.value.message  # acl.get_recent_err_msg()
    assert not fault.exists()
    backend.unload()


@pytest.mark.usefixtures("acl")
def test_device_usage_reads_memory_and_utilization(tmp_path: Path) -> None:
    backend, _ = _loaded(write_affine_om(tmp_path / "model.om", gears=GEARS))
    usage = backend.device_usage()
    assert usage is not None
    assert usage.memory_total_bytes == 8 << 30
    assert 0 < usage.memory_used_bytes < usage.memory_total_bytes
    assert usage.utilization is not None and 0.0 <= usage.utilization <= 1.0
    backend.unload()


@pytest.mark.usefixtures("acl")
def test_device_time_grows_with_the_gear_and_counts_as_busy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """t(b) = t0 + k*b: 2 ms + 0.5 ms per row of the gear that runs, spent on the device, not the host."""
    monkeypatch.setenv("ACL_SIM_EXECUTE_US", "2000")
    monkeypatch.setenv("ACL_SIM_EXECUTE_US_PER_ROW", "500")
    backend, _ = _loaded(write_affine_om(tmp_path / "model.om", gears=GEARS))
    runtime = _runtime()
    for rows, gear in ((1, 1), (3, 4), (8, 8)):
        before = runtime.busy_ns[0]
        backend.execute({"x": _rows(rows)}, ["y"])
        assert runtime.rows_executed[-1] == gear
        assert runtime.busy_ns[0] - before >= (2000 + 500 * gear) * 1000  # at least t(gear)
    backend.unload()


@pytest.mark.usefixtures("acl")
def test_utilization_that_reads_minus_one_is_unknown_not_idle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACL_SIM_UTILIZATION_UNKNOWN", "1")
    backend, _ = _loaded(write_affine_om(tmp_path / "model.om", gears=GEARS))
    usage = backend.device_usage()
    assert usage is not None and usage.memory_total_bytes == 8 << 30
    assert usage.utilization is None  # exported as no sample, never as 0
    backend.unload()


@pytest.mark.usefixtures("acl")
def test_outputs_report_the_largest_gear_and_padding_rows_never_reach_the_caller(tmp_path: Path) -> None:
    """aclmdlGetOutputDims gives [8, 4] for gears 1,2,4,8: the model loads, and a batch of 3 runs at
    gear 4 and answers 3 rows, read with get_cur_output_dims."""
    import acl

    backend, config = _loaded(write_affine_om(tmp_path / "model.om", gears=GEARS))
    desc = backend._desc
    y_index = next(
        i for i in range(acl.mdl.get_num_outputs(desc)) if acl.mdl.get_output_name_by_index(desc, i) == "Add_1:0:y"
    )
    assert acl.mdl.get_output_dims(desc, y_index)[0]["dims"] == [8, FEATURES]
    assert acl.mdl.get_input_dims(desc, 0)[0]["dims"] == [-1, FEATURES]
    assert [t.name for t in config.output] == ["y", "s"]  # shortest unique names
    assert config.parameters["om_output_name.y"].string_value == "Add_1:0:y"
    outputs = backend.execute({"x": _rows(3)}, ["y", "s"])
    assert outputs["y"].shape == (3, FEATURES) and outputs["s"].shape == (3, 1)
    assert acl.mdl.get_cur_output_dims(desc, y_index)[0]["dims"] == [4, FEATURES]
    backend.unload()


@pytest.mark.usefixtures("acl")
@pytest.mark.parametrize(
    ("name", "error"),
    [
        ("Add_1:0:y", None),
        ("y", None),
        ("Add_1:0", "is not in"),
        ("z", "is not in"),
    ],
)
def test_config_outputs_match_by_full_onnx_or_node_name(tmp_path: Path, name: str, error: str | None) -> None:
    from google.protobuf import text_format

    config = text_format.Parse(
        f'name: "affine" max_batch_size: 8 input {{ name: "x" data_type: TYPE_FP32 dims: [4] }} '
        f'output {{ name: "{name}" data_type: TYPE_FP32 dims: [4] }}',
        mc.ModelConfig(),
    )
    path = write_affine_om(tmp_path / "model.om", gears=GEARS)
    if error is None:
        backend, _ = _loaded(path, config)
        x = _rows(2)
        np.testing.assert_array_equal(backend.execute({"x": x}, [name])[name], affine_reference(x)["y"])
        backend.unload()
    else:
        with pytest.raises(ModelLoadError, match=error):
            _loaded(path, config)
    assert _runtime().leaks() == [] or error is not None


@pytest.mark.usefixtures("acl")
def test_an_ambiguous_output_name_lists_the_candidates(tmp_path: Path) -> None:
    from google.protobuf import text_format

    from tests.fakes.om_writer import write_om

    description = {
        "name": "two_heads",
        "inputs": [{"name": "x", "dtype": "float32", "dims": [1, 4], "format": "ND"}],
        "outputs": [
            {"name": "head_a/Conv:0:logits", "dtype": "float32", "dims": [1, 4], "format": "ND"},
            {"name": "head_b/Conv:0:logits", "dtype": "float32", "dims": [1, 4], "format": "ND"},
        ],
    }
    path = write_om(tmp_path / "model.om", description)
    backend, config = _loaded(path)
    assert [t.name for t in config.output] == ["head_a/Conv:0:logits", "head_b/Conv:0:logits"]  # no unique short form
    backend.unload()
    config = text_format.Parse(
        'name: "two_heads" input { name: "x" data_type: TYPE_FP32 dims: [1, 4] } '
        'output { name: "logits" data_type: TYPE_FP32 dims: [1, 4] }',
        mc.ModelConfig(),
    )
    with pytest.raises(
        ModelLoadError, match=r"matches several outputs .*\['head_a/Conv:0:logits', 'head_b/Conv:0:logits'\]"
    ):
        _loaded(path, config)


@pytest.mark.usefixtures("acl")
@pytest.mark.parametrize(
    ("dynamic", "kind"),
    [
        (
            {"dynamic_image_size": [[224, 224], [448, 448]], "data_name_order": ["x"]},
            "image size gears (ATC --dynamic_image_size",
        ),
        ({"dynamic_dims": [[1, 4], [1, 8]], "data_name_order": ["x"]}, "dims gears (ATC --dynamic_dims"),
    ],
)
def test_image_size_and_dims_gears_are_refused_naming_the_kind(
    tmp_path: Path, dynamic: dict[str, Any], kind: str
) -> None:
    from tests.fakes.om_writer import write_om

    dims = [1, 3, -1, -1] if "dynamic_image_size" in dynamic else [1, -1]
    description = {
        "name": "gears",
        "inputs": [
            {"name": "x", "dtype": "float32", "dims": dims, "format": "NCHW"},
            {"name": "ascend_mbatch_shape_data", "dtype": "int32", "dims": [2], "format": "ND"},
        ],
        "outputs": [{"name": "out:0", "dtype": "float32", "dims": [1, 10], "format": "ND"}],
        "dynamic": dynamic,
    }
    with pytest.raises(ModelLoadError, match=re.escape(kind)):
        _loaded(write_om(tmp_path / "model.om", description))
    assert _runtime().leaks() == []


def _affine_missing_s_at_batch_2(path: Path) -> Path:
    """The affine graph at gears 1, 2, 4, 8 with ATC's `_dynamic_output_dims` less output 1's (s) at
    gear index 1 (batch 2), and its ONNX twin for the simulator to run."""
    entries = [f"{i},0,{gear},{FEATURES}" for i, gear in enumerate(GEARS)]
    entries += [f"{i},1,{gear},1" for i, gear in enumerate(GEARS) if gear != 2]
    write_om(path, affine_description(GEARS), dynamic_output_dims=entries)
    twin_path(path).write_bytes(affine_onnx(batch="batch"))
    return path


@pytest.mark.usefixtures("acl")
def test_a_gear_file_without_dims_for_an_output_at_a_gear_is_refused_before_the_runtime_loads_it(
    tmp_path: Path,
) -> None:
    path = _affine_missing_s_at_batch_2(tmp_path / "model.om")
    with pytest.raises(ModelLoadError) as error:
        _loaded(path)
    message = error.value.message
    assert f"model 'affine': '{path}' has batch gears [1, 2, 4, 8]" in message
    assert "give no dims for output 1 'ReduceSum_2:0:s' at batch size 2:" in message
    assert "compile the model again with ATC" in message
    assert _runtime().calls["mdl.load_from_file"] == 0 and _runtime().leaks() == []  # refused before loading


@pytest.mark.usefixtures("acl")
def test_a_failed_get_cur_output_dims_fails_the_request_not_the_instance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the load check (here bypassed), the runtime has no dims for s at batch 2: that batch's request
    fails naming the output and the batch size, as an InternalError, and the instance keeps serving."""
    import geserve.backends.acl.backend as backend_module

    monkeypatch.setattr(backend_module, "check_output_dims", lambda *_: None)
    backend, _ = _loaded(_affine_missing_s_at_batch_2(tmp_path / "model.om"))
    with pytest.raises(InternalError) as error:
        backend.execute({"x": _rows(2)}, ["y", "s"])
    assert not isinstance(error.value, DeviceFaultError)
    message = error.value.message
    assert "acl.mdl.get_cur_output_dims failed with error 500001 (ACL_ERROR_FAILURE)" in message
    assert "no entry for output 1 at gear index 1" in message  # acl.get_recent_err_msg()
    assert "output 's' (index 1) at batch size 2" in message and "instance restarts" not in message
    for rows, names in ((2, ["y"]), (3, ["y", "s"]), (1, ["y", "s"])):  # the same instance, still serving
        x = _rows(rows)
        outputs = backend.execute({"x": x}, names)
        for name in names:
            np.testing.assert_array_equal(outputs[name], affine_reference(x)[name])
    backend.unload()
    assert _runtime().leaks() == []


# -- the simulator keeps the binding's rules ------------------------------------------------------


def test_return_conventions_and_lifecycle_codes(acl: Any) -> None:
    assert acl.rt.malloc(64, 2) == (0, 100001)  # before acl.init
    assert acl.init() == 0
    assert acl.init() == 100002  # repeated init
    assert acl.rt.create_stream() == (0, 107002)  # no current context
    assert "no current context" in acl.get_recent_err_msg()
    assert acl.get_recent_err_msg() == ""  # read and cleared
    assert acl.rt.set_device(5) == 107001
    assert acl.rt.set_device(0) == 0
    context, ret = acl.rt.create_context(0)
    assert ret == 0 and isinstance(context, int) and context
    assert acl.rt.destroy_context(context) == 0
    assert acl.rt.reset_device(0) == 0
    assert acl.finalize() == 0
    assert acl.finalize() == 100037


def test_device_memory_is_reached_only_through_memcpy(acl: Any) -> None:
    acl.init()
    acl.rt.set_device(0)
    device, ret = acl.rt.malloc(64, 2)
    assert ret == 0
    host = np.arange(16, dtype=np.float32)
    back = np.zeros(16, dtype=np.float32)
    assert acl.rt.memcpy(device, 32, host.ctypes.data, 64, 1) == 100000  # count > dest_max
    assert acl.rt.memcpy(device, 64, host.ctypes.data, 64, 1) == 0
    assert acl.util.ptr_to_bytes(device, 64) == b""  # reading device memory on the host fails
    assert "copy it to the host" in acl.get_recent_err_msg()
    assert acl.rt.memcpy(back.ctypes.data, 64, device, 64, 2) == 0
    np.testing.assert_array_equal(back, host)
    assert acl.rt.free(device) == 0
    assert acl.rt.free(device) == 107000  # double free
    acl.rt.reset_device(0)
    acl.finalize()


def test_finalize_reports_what_was_not_released(acl: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACL_SIM_REPORT_DIR", str(tmp_path))
    acl.init()
    acl.rt.set_device(0)
    acl.rt.malloc(128, 0)
    acl.mdl.create_dataset()
    acl.finalize()
    import json

    report = json.loads(next(tmp_path.glob("acl-sim-*.json")).read_text())
    assert report["finalized"]
    assert any("device memory" in leak for leak in report["leaks"])
    assert any("dataset" in leak for leak in report["leaks"])
    assert "device 0 not reset" in report["leaks"]


def test_non_gear_batch_and_models_used_outside_their_context(acl: Any, tmp_path: Path) -> None:
    path = write_affine_om(tmp_path / "model.om", gears=GEARS)
    acl.init()
    acl.rt.set_device(0)
    acl.rt.create_context(0)
    model_id, ret = acl.mdl.load_from_file(str(path))
    assert ret == 0
    assert acl.mdl.load_from_file(str(tmp_path / "missing.om")) == (0, 100014)
    dataset = acl.mdl.create_dataset()
    address, _ = acl.rt.malloc(8, 2)
    buffer = acl.create_data_buffer(address, 8)
    acl.mdl.add_dataset_buffer(dataset, acl.create_data_buffer(0, 0))
    acl.mdl.add_dataset_buffer(dataset, buffer)
    assert acl.mdl.set_dynamic_batch_size(model_id, dataset, 1, 3) == 145013
    assert acl.mdl.set_dynamic_batch_size(model_id, dataset, 1, 4) == 0
    assert acl.rt.create_context(1)[1] == 0
    assert acl.mdl.execute(model_id, dataset, dataset) == 107004  # loaded under another context
    assert acl.mdl.unload(model_id) == 107004


def test_execute_holds_the_gil_as_the_real_binding_does(acl: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACL_SIM_EXECUTE_US", "500000")
    with _Counting() as ticks:
        during_execute = ticks.during(lambda: _runtime().spend_device_time(1))  # what every execute ends with
        during_sleep = ticks.during(lambda: time.sleep(0.5))
    # At most a switch interval or two of counting slips in around the call; none during it.
    assert during_execute * 5 < during_sleep, (during_execute, during_sleep)


def test_handles_are_plain_ints_and_bytes_to_ptr_takes_only_bytes(acl: Any) -> None:
    data = b"\x01\x02\x03\x04"
    address = acl.util.bytes_to_ptr(data)
    assert isinstance(address, int) and ctypes.string_at(address, 4) == data
    with pytest.raises(ValueError, match="only bytes"):
        acl.util.bytes_to_ptr(bytearray(data))


def test_arguments_are_refused_where_the_bindings_parse_formats_refuse_them(acl: Any, tmp_path: Path) -> None:
    """Handles, pointers, sizes and indexes are parsed as "k"/"K": an int only, never a numpy integer or a float;
    ids and codes as "i"/"I": anything with __index__ (numpy integers too), never a float. What the parser refuses,
    the binding's CHECK_NULL turns into a TypeError of its own."""
    acl.init()
    assert acl.rt.set_device(np.int64(0)) == 0  # "i"
    with pytest.raises(TypeError, match=r"^acl\.rt\.set_device args parse failed$"):
        acl.rt.set_device(0.0)
    with pytest.raises(TypeError, match=r"^acl\.rt\.set_device args parse failed$"):
        acl.rt.set_device(1 << 31)  # past a C int
    with pytest.raises(TypeError, match=r"^acl\.rt\.malloc args parse failed$"):
        acl.rt.malloc(np.int64(64), 2)  # "ki"
    address, ret = acl.rt.malloc(64, np.int32(2))
    assert ret == 0
    with pytest.raises(TypeError, match=r"^acl\.create_data_buffer args parse failed$"):
        acl.create_data_buffer(address, 64.0)
    with pytest.raises(TypeError, match=r"^acl\.rt\.memcpy args parse failed$"):
        acl.rt.memcpy(address, 64, np.uint64(0), 0, 1)
    with pytest.raises(TypeError, match=r"^acl\.rt\.memcpy args parse failed$"):
        acl.rt.memcpy(address, 64)  # too few
    stream, _ = acl.rt.create_stream()
    with pytest.raises(TypeError, match=r"^acl\.rt\.synchronize_stream_with_timeout args parse failed$"):
        acl.rt.synchronize_stream_with_timeout(stream, 1.5)
    assert acl.rt.synchronize_stream_with_timeout(stream, np.int64(100)) == 0
    path = write_affine_om(tmp_path / "model.om", gears=GEARS)
    with pytest.raises(TypeError, match=r"^acl\.mdl\.load_from_file args parse failed!$"):
        acl.mdl.load_from_file(path)  # "s": a str, not a Path
    model_id, _ = acl.mdl.load_from_file(str(path))
    dataset = acl.mdl.create_dataset()
    with pytest.raises(TypeError, match=r"^acl\.mdl\.set_dynamic_batch_size args parse failed!$"):
        acl.mdl.set_dynamic_batch_size(model_id, dataset, 1, np.int64(4))  # the batch is "K"
    with pytest.raises(TypeError, match=r"^acl\.mdl\.execute_async args parse failed!$"):
        acl.mdl.execute_async(model_id, dataset, dataset, float(stream))
    assert acl.mdl.unload(np.uint32(model_id)) == 0  # "I"
    for release in (
        lambda: acl.mdl.destroy_dataset(dataset),
        lambda: acl.rt.free(address),
        lambda: acl.rt.destroy_stream(stream),
        lambda: acl.rt.reset_device(0),
        acl.finalize,
    ):
        assert release() == 0


@pytest.mark.usefixtures("acl")
def test_the_next_batch_is_staged_on_the_other_side_while_one_runs(tmp_path: Path) -> None:
    """stage A, launch A, stage B (copied while A runs), finish A, launch B, finish B: each gets its own rows."""
    backend, _ = _loaded(write_affine_om(tmp_path / "model.om", gears=GEARS))
    first, second = _rows(3), _rows(5) + 100
    staged_first = backend.stage({"x": first})
    backend.launch(staged_first)
    staged_second = backend.stage({"x": second})  # the runtime would refuse a copy into the running side
    with pytest.raises(InternalError, match="two batches are already staged or running"):
        backend.stage({"x": first})
    with pytest.raises(InternalError, match="before the previous one finished"):
        backend.launch(staged_second)
    np.testing.assert_array_equal(backend.finish(staged_first, ["y"])["y"], affine_reference(first)["y"])
    backend.launch(staged_second)
    np.testing.assert_array_equal(backend.finish(staged_second, ["y"])["y"], affine_reference(second)["y"])
    assert _runtime().calls["mdl.create_dataset"] == 3  # two input sides, one output dataset
    backend.unload()  # frees both sides: the leak check of the `acl` fixture would say otherwise


@pytest.mark.usefixtures("acl")
def test_each_requests_rows_are_copied_to_their_place_on_the_device_and_the_gear_padded(tmp_path: Path) -> None:
    """stage_blocks: the requests' row blocks, where they lie, each copied to its offset in the device buffer; the
    batch is never joined in host memory, and the rows the gear adds are zeros."""
    backend, _ = _loaded(write_affine_om(tmp_path / "model.om", gears=GEARS))
    blocks = [_rows(1), _rows(2) + 10, _rows(2) + 20]
    staged = backend.stage_blocks({"x": blocks})
    backend.launch(staged)
    joined = np.concatenate(blocks)
    np.testing.assert_array_equal(backend.finish(staged, ["y"])["y"], affine_reference(joined)["y"])
    assert _runtime().calls["rt.memcpy"] >= len(blocks)
    backend.unload()


@pytest.mark.usefixtures("acl")
def test_a_discarded_batch_gives_its_side_back(tmp_path: Path) -> None:
    backend, _ = _loaded(write_affine_om(tmp_path / "model.om", gears=GEARS))
    running = backend.stage({"x": _rows(2)})
    backend.launch(running)
    backend.discard(backend.stage({"x": _rows(2)}))  # its batch failed before launch
    backend.finish(running, ["y"])
    for _ in range(3):
        np.testing.assert_array_equal(backend.execute({"x": _rows(4)}, ["y"])["y"], affine_reference(_rows(4))["y"])
    backend.unload()


def test_launched_work_ends_at_synchronize(acl: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """execute_async queues t(b) on the device: the outputs appear and the time counts as busy only once the
    stream is synchronized, and host copies into or out of the buffers it uses are refused until then."""
    monkeypatch.setenv("ACL_SIM_EXECUTE_US", "20000")
    assert acl.init() == 0 and acl.rt.set_device(0) == 0
    context, _ = acl.rt.create_context(0)
    stream, _ = acl.rt.create_stream()
    model_id, ret = acl.mdl.load_from_file(str(write_affine_om(tmp_path / "model.om", gears=GEARS)))
    assert ret == 0
    datasets, buffers = [], []
    for size in (4 * FEATURES * 4, 4, 4 * FEATURES * 4, 4 * 4):  # x at gear 4, the batch tensor; y, s
        address, _ = acl.rt.malloc(size, 0)
        buffers.append((address, acl.create_data_buffer(address, size)))
    for group in (buffers[:2], buffers[2:]):
        dataset = acl.mdl.create_dataset()
        for _, data_buffer in group:
            acl.mdl.add_dataset_buffer(dataset, data_buffer)
        datasets.append(dataset)
    x = np.ascontiguousarray(_rows(4))
    (x_device, _), (y_device, _) = buffers[0], buffers[2]
    assert acl.rt.memcpy(x_device, x.nbytes, x.ctypes.data, x.nbytes, 1) == 0
    assert acl.mdl.set_dynamic_batch_size(model_id, datasets[0], 1, 4) == 0
    busy = _runtime().busy_ns[0]
    assert acl.mdl.execute_async(model_id, datasets[0], datasets[1], stream) == 0
    y = np.zeros((4, FEATURES), dtype=np.float32)
    assert acl.rt.memcpy(y.ctypes.data, y.nbytes, y_device, y.nbytes, 2) == 107000  # still running
    assert "synchronize the stream first" in acl.get_recent_err_msg()
    assert acl.rt.memcpy(x_device, x.nbytes, x.ctypes.data, x.nbytes, 1) == 107000  # its input, still read
    assert _runtime().busy_ns[0] == busy
    assert acl.rt.synchronize_stream(stream) == 0
    assert _runtime().busy_ns[0] - busy == 20_000_000
    assert acl.rt.memcpy(y.ctypes.data, y.nbytes, y_device, y.nbytes, 2) == 0
    np.testing.assert_array_equal(y, affine_reference(x)["y"])
    for dataset in datasets:
        acl.mdl.destroy_dataset(dataset)
    for address, data_buffer in buffers:
        acl.destroy_data_buffer(data_buffer)
        acl.rt.free(address)
    assert acl.mdl.unload(model_id) == 0
    acl.rt.destroy_stream(stream)
    acl.rt.destroy_context(context)
    acl.rt.reset_device(0)
    acl.finalize()


def test_synchronize_waits_without_the_gil(acl: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The binding releases the GIL in synchronize_stream: the host keeps working while the device runs."""
    monkeypatch.setenv("ACL_SIM_EXECUTE_US", "300000")
    assert acl.init() == 0 and acl.rt.set_device(0) == 0
    context, _ = acl.rt.create_context(0)
    stream, _ = acl.rt.create_stream()
    model_id, _ = acl.mdl.load_from_file(str(write_affine_om(tmp_path / "model.om", gears=GEARS)))
    backend_free = []
    sizes = (FEATURES * 4, 4, FEATURES * 4, 4)
    datasets = [acl.mdl.create_dataset(), acl.mdl.create_dataset()]
    for index, size in enumerate(sizes):
        address, _ = acl.rt.malloc(size, 0)
        data_buffer = acl.create_data_buffer(address, size)
        acl.mdl.add_dataset_buffer(datasets[index // 2], data_buffer)
        backend_free.append((address, data_buffer))
    acl.mdl.set_dynamic_batch_size(model_id, datasets[0], 1, 1)
    with _Counting() as ticks:
        assert acl.mdl.execute_async(model_id, datasets[0], datasets[1], stream) == 0
        during_synchronize = ticks.during(lambda: acl.rt.synchronize_stream(stream))
        during_execute = ticks.during(lambda: _runtime().spend_device_time(1))  # a synchronous execute's wait
    assert during_execute * 5 < during_synchronize, (during_execute, during_synchronize)
    for dataset in datasets:
        acl.mdl.destroy_dataset(dataset)
    for address, data_buffer in backend_free:
        acl.destroy_data_buffer(data_buffer)
        acl.rt.free(address)
    acl.mdl.unload(model_id)
    acl.rt.destroy_stream(stream)
    acl.rt.destroy_context(context)
    acl.rt.reset_device(0)
    acl.finalize()
