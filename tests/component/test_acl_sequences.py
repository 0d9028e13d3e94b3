"""A sequence model compiled to `.om`: control and state tensors reach the NPU as ordinary graph inputs (simulator)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

from geserve.backends.acl.description import DYNAMIC_TENSOR_NAME
from geserve.repository.config import parse_config_text
from geserve.workers.messages import SEQUENCE_END, SEQUENCE_READY, SEQUENCE_START, InstanceSpec, RequestInfo
from geserve.workers.runner import InstanceRunner
from tests.fakes.acl.om import twin_path
from tests.fakes.om_models import onnx_bytes, write_affine_om
from tests.fakes.om_writer import write_om

GEARS = [1, 2, 4]
CONFIG = """
name: "om_sequence"
backend: "ge"
max_batch_size: 4
sequence_batching {
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] }
  ]
  state [ { input_name: "INPUT_STATE" output_name: "OUTPUT_STATE" data_type: TYPE_INT32 dims: [ 1 ] } ]
}
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""


def _graph() -> bytes:
    """OUTPUT_STATE = INPUT_STATE + INPUT; OUTPUT = READY * (OUTPUT_STATE + 100 * START)."""
    column = ["batch", 1]
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["INPUT_STATE", "INPUT"], ["OUTPUT_STATE"], name="Add_0"),
            helper.make_node("Mul", ["START", "hundred"], ["started"], name="Mul_1"),
            helper.make_node("Add", ["OUTPUT_STATE", "started"], ["marked"], name="Add_2"),
            helper.make_node("Mul", ["READY", "marked"], ["OUTPUT"], name="Mul_3"),
        ],
        "om_sequence",
        [
            helper.make_tensor_value_info(n, TensorProto.INT32, column)
            for n in ("INPUT", "START", "READY", "INPUT_STATE")
        ],
        [helper.make_tensor_value_info(n, TensorProto.INT32, column) for n in ("OUTPUT", "OUTPUT_STATE")],
        [helper.make_tensor("hundred", TensorProto.INT32, [], [100])],
    )
    return onnx_bytes(graph)


def _write_om(path: Path) -> Path:
    """The graph as ATC describes it: batch gears, outputs renamed `<node>:<index>:<onnx name>`."""
    inputs = [
        {"name": name, "dtype": "int32", "dims": [-1, 1], "format": "ND"}
        for name in ("INPUT", "START", "READY", "INPUT_STATE")
    ]
    inputs.append({"name": DYNAMIC_TENSOR_NAME, "dtype": "int32", "dims": [1], "format": "ND"})
    description = {
        "name": "om_sequence",
        "soc_version": "Ascend310P3",
        "inputs": inputs,
        "outputs": [
            {"name": "Mul_3:0:OUTPUT", "dtype": "int32", "dims": [max(GEARS), 1], "format": "ND"},
            {"name": "Add_0:0:OUTPUT_STATE", "dtype": "int32", "dims": [max(GEARS), 1], "format": "ND"},
        ],
        "dynamic": {"dynamic_batch": GEARS, "data_name_order": ["INPUT", "START", "READY", "INPUT_STATE"]},
    }
    write_om(path, description)
    twin_path(path).write_bytes(_graph())
    return path


def _spec(name: str, config_text: str, model: Path) -> InstanceSpec:
    """An instance of the `.om` at `model`, its config auto-completed from it."""
    config = parse_config_text(config_text, "config.pbtxt").SerializeToString()
    return InstanceSpec(name, 1, f"{name}_0", "ge", config, str(model), 0, True, 30, model_directory=str(model.parent))


def _column(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32).reshape(-1, 1)


@pytest.mark.usefixtures("acl")
def test_om_sequence_gets_controls_and_keeps_state_per_slot(tmp_path: Path) -> None:
    runner = InstanceRunner(_spec("om_sequence", CONFIG, _write_om(tmp_path / "model.om")))
    served = runner.load()
    assert [tensor.name for tensor in served.input] == ["INPUT"]  # controls and state are not the client's
    ready = SEQUENCE_READY

    def step(values: list[int], starts: list[int], readies: list[int], flags: list[int]) -> list[int]:
        requests = [RequestInfo(1, ("OUTPUT",), slot=slot, sequence_flags=f) for slot, f in enumerate(flags)]
        inputs = {"INPUT": _column(*values), "START": _column(*starts), "READY": _column(*readies)}
        result = runner.execute(inputs, ("OUTPUT",), requests)
        outputs = []
        for answer in result.results:
            assert isinstance(answer, dict), answer
            assert set(answer) == {"OUTPUT"}  # the state output stays in the worker
            outputs.append(int(answer["OUTPUT"].item()))
        return outputs

    # Slot 0 starts; slot 1 is padding (READY 0), its state not kept.
    assert step([5, 9], [1, 0], [1, 0], [ready | SEQUENCE_START, 0]) == [105, 0]
    # Slot 0 continues from 5; slot 1 starts from zero, not from the padding's 9.
    assert step([2, 3], [0, 1], [1, 1], [ready, ready | SEQUENCE_START]) == [7, 103]
    # Slot 0 ends; slot 1 goes on.
    assert step([1, 4], [0, 0], [1, 1], [ready | SEQUENCE_END, ready]) == [8, 7]
    # A new sequence in slot 0 starts from zero again.
    assert step([6], [1], [1], [ready | SEQUENCE_START]) == [106]
    runner.unload()


@pytest.mark.usefixtures("acl")
def test_a_stateful_om_never_stages_a_batch_before_the_running_one_kept_its_state(tmp_path: Path) -> None:
    """The worker stages the next batch while one runs only where no implicit state links them."""
    stateful = InstanceRunner(_spec("om_sequence", CONFIG, _write_om(tmp_path / "model.om")))
    stateful.load()
    assert stateful.pipelined and not stateful.stages_ahead
    stateful.unload()
    plain = write_affine_om(tmp_path / "affine" / "model.om", gears=GEARS)
    stateless = InstanceRunner(_spec("affine", 'name: "affine" backend: "ge"', plain))
    stateless.load()
    assert stateless.stages_ahead
    stateless.unload()
