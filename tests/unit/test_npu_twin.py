"""The NPU tests' comparison with the ONNX twin, run here on onnxruntime: row-by-row runs, casts, fp16 tolerance."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.npu_twin import (
    assert_matches_twin,
    by_config_names,
    first_device_id,
    open_twin,
    rows_per_run,
    run_twin,
    twin_feed,
)

WEIGHTS = np.array([[0.5, -1.25], [2.0, 0.75], [-0.5, 1.5]], dtype=np.float32)
BIAS = np.array([0.25, -0.125], dtype=np.float32)


def _affine_twin(tmp_path: Path, batch: int | str, input_type: int = TensorProto.FLOAT, name: str = "x") -> Path:
    """y = x @ WEIGHTS + BIAS, its batch dim fixed at `batch` (an int) or dynamic (a name)."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", [name, "w"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["y"])],
        "affine",
        [helper.make_tensor_value_info(name, input_type, [batch, 3])],
        [helper.make_tensor_value_info("y", input_type, [batch, 2])],
        initializer=[
            numpy_helper.from_array(WEIGHTS.astype(helper.tensor_dtype_to_np_dtype(input_type)), "w"),
            numpy_helper.from_array(BIAS.astype(helper.tensor_dtype_to_np_dtype(input_type)), "b"),
        ],
    )
    model = helper.make_model(graph, ir_version=9, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    path = tmp_path / f"affine-{batch}.onnx"
    onnx.save(model, path)
    return path


def _rows(batch: int, dtype: type[np.generic] = np.float32) -> np.ndarray:
    return np.random.default_rng(batch).uniform(0, 1, size=(batch, 3)).astype(dtype)


def test_a_twin_with_batch_one_runs_row_by_row_for_a_batch_of_four(tmp_path: Path) -> None:
    twin = open_twin(str(_affine_twin(tmp_path, 1)))
    rows = _rows(4)
    with pytest.raises(Exception, match="dimension"):
        twin.run(None, {"x": rows})  # what the old comparison did: onnxruntime refuses the whole batch
    assert rows_per_run(twin, 4) == 1
    outputs = run_twin(twin, {"INPUT": rows}, 4)
    np.testing.assert_allclose(outputs["y"], rows @ WEIGHTS + BIAS, rtol=1e-6)


def test_a_twin_with_a_dynamic_batch_dim_runs_the_batch_at_once(tmp_path: Path) -> None:
    twin = open_twin(str(_affine_twin(tmp_path, "N")))
    assert rows_per_run(twin, 5) == 5
    rows = _rows(5)
    np.testing.assert_allclose(run_twin(twin, {"x": rows}, 5)["y"], rows @ WEIGHTS + BIAS, rtol=1e-6)


def test_a_twin_with_a_fixed_batch_runs_in_slices_of_that_size(tmp_path: Path) -> None:
    twin = open_twin(str(_affine_twin(tmp_path, 2)))
    assert rows_per_run(twin, 6) == 2
    rows = _rows(6)
    np.testing.assert_allclose(run_twin(twin, {"x": rows}, 6)["y"], rows @ WEIGHTS + BIAS, rtol=1e-6)


@pytest.mark.parametrize("batch", [1, 3, 5])
def test_a_batch_the_fixed_size_does_not_divide_is_padded_and_the_padding_dropped(tmp_path: Path, batch: int) -> None:
    twin = open_twin(str(_affine_twin(tmp_path, 4)))
    rows = _rows(batch)
    with pytest.raises(Exception, match="dimension"):
        twin.run(None, {"x": rows[:1]})
    outputs = run_twin(twin, {"x": rows}, batch)
    assert outputs["y"].shape == (batch, 2)
    np.testing.assert_allclose(outputs["y"], rows @ WEIGHTS + BIAS, rtol=1e-6)


def test_a_model_without_a_batch_dim_runs_whole(tmp_path: Path) -> None:
    twin = open_twin(str(_affine_twin(tmp_path, 4)))
    assert rows_per_run(twin, 0) == 0
    rows = _rows(4)
    np.testing.assert_allclose(run_twin(twin, {"x": rows}, 0)["y"], rows @ WEIGHTS + BIAS, rtol=1e-6)


def test_fp16_inputs_are_cast_to_the_fp32_twin(tmp_path: Path) -> None:
    twin = open_twin(str(_affine_twin(tmp_path, "N")))
    rows = _rows(3, np.float16)
    with pytest.raises(Exception, match=r"tensor\(float16\)"):
        twin.run(None, {"x": rows})  # onnxruntime takes no fp16 for an fp32 input
    feed = twin_feed(twin, {"x": rows})
    assert feed["x"].dtype == np.float32
    np.testing.assert_array_equal(feed["x"], rows.astype(np.float32))
    np.testing.assert_allclose(run_twin(twin, {"x": rows}, 3)["y"], rows.astype(np.float32) @ WEIGHTS + BIAS)


def test_fp32_inputs_are_cast_to_an_fp16_twin(tmp_path: Path) -> None:
    twin = open_twin(str(_affine_twin(tmp_path, "N", TensorProto.FLOAT16)))
    outputs = run_twin(twin, {"x": _rows(2)}, 2)
    assert outputs["y"].dtype == np.float16


def test_inputs_go_by_name_and_by_position_where_the_twin_names_them_otherwise(tmp_path: Path) -> None:
    graph = helper.make_graph(
        [helper.make_node("Sub", ["a", "b"], ["d"])],
        "sub",
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["N", 2]) for name in ("a", "b")],
        [helper.make_tensor_value_info("d", TensorProto.FLOAT, ["N", 2])],
    )
    path = tmp_path / "sub.onnx"
    onnx.save(helper.make_model(graph, ir_version=9, opset_imports=[helper.make_opsetid("", 17)]), path)
    twin = open_twin(str(path))
    one, two = np.ones((1, 2), np.float32), np.full((1, 2), 3, np.float32)
    # By name, whatever the order the server's metadata lists them in.
    np.testing.assert_array_equal(run_twin(twin, {"b": two, "a": one}, 1)["d"], one - two)
    # By position, where the config calls them otherwise.
    np.testing.assert_array_equal(run_twin(twin, {"INPUT1": two, "INPUT0": one}, 1)["d"], two - one)
    with pytest.raises(ValueError, match="takes 2 inputs, the model 1"):
        twin_feed(twin, {"a": one})


def test_outputs_are_found_by_the_config_name_the_onnx_name_inside_atcs_full_name_or_position() -> None:
    values = {"logits": np.zeros(1), "boxes": np.ones(1), "third": np.full(1, 2.0)}
    config = {
        "output": [{"name": "boxes"}, {"name": "scores"}, {"name": "extra"}],
        "parameters": {"om_output_name.scores": {"string_value": "PartitionedCall_/Gemm:0:logits"}},
    }
    found = by_config_names(config, values)
    assert found["boxes"] is values["boxes"]
    assert found["scores"] is values["logits"]
    assert found["extra"] is values["third"]


def test_an_fp16_computation_of_the_twin_passes_the_tolerance_and_a_wrong_answer_does_not() -> None:
    rows = _rows(64)
    reference = rows @ WEIGHTS + BIAS
    # What force_fp16 does to this model: inputs, weights and the result rounded to fp16, fp16 arithmetic.
    on_npu = (rows.astype(np.float16) @ WEIGHTS.astype(np.float16) + BIAS.astype(np.float16)).astype(np.float16)
    assert not np.array_equal(on_npu.astype(np.float32), reference)
    assert_matches_twin("y", on_npu, reference)
    with pytest.raises(AssertionError, match="output 'y' against the ONNX twin"):
        assert_matches_twin("y", (reference * 1.05).astype(np.float16), reference)
    with pytest.raises(AssertionError, match="shape"):
        assert_matches_twin("y", on_npu[:1], reference)


def test_elements_near_zero_are_held_to_the_tensors_scale() -> None:
    reference = np.array([100.0, 1e-3], dtype=np.float32)
    # 0.5 off on an element of 1e-3: far outside 2 % of itself, within 2 % of the tensor's largest value.
    assert_matches_twin("y", np.array([100.5, 0.5], dtype=np.float16), reference)
    with pytest.raises(AssertionError):
        assert_matches_twin("y", np.array([100.0, 3.0], dtype=np.float16), reference)


def test_integer_outputs_must_match_exactly() -> None:
    reference = np.array([3, 7, 1000], dtype=np.int64)
    assert_matches_twin("classes", reference.copy(), reference)
    with pytest.raises(AssertionError, match="output 'classes'"):
        assert_matches_twin("classes", np.array([3, 7, 1001], dtype=np.int64), reference)


@pytest.mark.parametrize(("devices", "first"), [("", 0), ("2", 2), ("3,1", 3), (" 1 , 0", 1)])
def test_the_device_opened_is_the_first_that_geserve_npu_devices_lists(devices: str, first: int) -> None:
    assert first_device_id(devices) == first
