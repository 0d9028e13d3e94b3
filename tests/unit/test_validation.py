"""Request validation against a model config, with Triton's texts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from geserve.core import validation
from geserve.core.models import ModelVersion
from geserve.errors import InvalidArgumentError, UnsupportedError
from geserve.repository.config import parse_config_text
from geserve.residency import Kind, Residency, SharedTensor
from geserve.types import InferInput, InferRequest, Parameters, RequestedOutput
from tests.unit.builders import model_version

CONFIG = """
name: "m"
max_batch_size: 4
input [
  { name: "A" data_type: TYPE_INT32 dims: [ 2, -1 ] },
  { name: "S" data_type: TYPE_STRING dims: [ 2 ] },
  { name: "R" data_type: TYPE_FP32 dims: [ 4 ] reshape: { shape: [ 2, 2 ] } },
  { name: "O" data_type: TYPE_FP32 dims: [ 1 ] optional: true }
]
output [ { name: "X" data_type: TYPE_INT32 dims: [ 2, -1 ] }, { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""


@pytest.fixture(scope="module")
def model() -> ModelVersion:
    return model_version(parse_config_text(CONFIG, "c"))


def raw(array: np.ndarray) -> memoryview:
    return memoryview(array.tobytes())


def good_inputs(batch: int = 1) -> list[InferInput]:
    strings = np.array([b"x", b"yz"] * batch, dtype=object).reshape(batch, 2)
    return [
        InferInput("A", "INT32", (batch, 2, 3), raw(np.arange(batch * 6, dtype=np.int32))),
        InferInput("S", "BYTES", (batch, 2), strings),
        InferInput("R", "FP32", (batch, 4), raw(np.ones(batch * 4, dtype=np.float32))),
    ]


def request(inputs: list[InferInput], **kwargs: Any) -> InferRequest:
    return InferRequest("m", "", tuple(inputs), **kwargs)


def test_good_request_becomes_arrays(model: ModelVersion) -> None:
    tensors = validation.validate_inputs(request(good_inputs(3)), model)
    assert tensors["A"].shape == (3, 2, 3) and tensors["A"].dtype == np.int32
    assert tensors["A"].array.shape == (3, 2, 3) and tensors["A"].array.dtype == np.int32
    assert tensors["A"].array[2, 1, 2] == 17
    assert tensors["R"].shape == (3, 2, 2) and tensors["R"].array.shape == (3, 2, 2)  # reshaped for the backend
    assert tensors["S"].datatype == "BYTES" and tensors["S"].array[1, 1] == b"yz"
    assert "O" not in tensors  # optional inputs may be left out


def replace_input(index: int, tensor: InferInput) -> list[InferInput]:
    inputs = good_inputs()
    inputs[index] = tensor
    return inputs


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        (
            [*good_inputs(), InferInput("Z", "FP32", (1,), raw(np.zeros(1, np.float32)))],
            "unexpected inference input 'Z' for model 'm'",
        ),
        (good_inputs() + good_inputs()[:1], "input 'A' already exists in request"),
        (
            replace_input(0, InferInput("A", "INT64", (1, 2, 3), raw(np.zeros(6, np.int64)))),
            "inference input 'A' data-type is 'INT64', but model 'm' expects 'INT32'",
        ),
        (
            replace_input(0, InferInput("A", "INT32", (5, 2, 3), raw(np.zeros(30, np.int32)))),
            "inference request batch-size must be <= 4 for 'm'",
        ),
        (
            replace_input(0, InferInput("A", "INT32", (1, 3, 3), raw(np.zeros(9, np.int32)))),
            "unexpected shape for input 'A' for model 'm'. Expected [-1,2,-1], got [1,3,3]",
        ),
        (
            replace_input(0, InferInput("A", "INT32", (), raw(np.zeros(1, np.int32)))),
            "unexpected shape for input 'A' for model 'm'. Expected [-1,2,-1], got []",
        ),
        (
            replace_input(0, InferInput("A", "INT32", (1, 2, 3), raw(np.zeros(5, np.int32)))),
            "input byte size mismatch for input 'A' for model 'm'. Expected 24, got 20",
        ),
        (
            replace_input(2, InferInput("R", "FP32", (2, 4), raw(np.zeros(8, np.float32)))),
            "input 'R' batch size does not match other inputs for 'm'",
        ),
        (
            good_inputs()[:1],
            "expected 3 inputs but got 1 inputs for model 'm'. Got input(s) ['A'], but missing required input(s) ['S', 'R']. Please provide all required input(s).",
        ),
    ],
)
def test_invalid_inputs(model: ModelVersion, inputs: list[InferInput], message: str) -> None:
    with pytest.raises(InvalidArgumentError) as error:
        validation.validate_inputs(request(inputs), model)
    assert error.value.message == message


def test_huge_declared_shape_is_refused_before_allocating(model: ModelVersion) -> None:
    inputs = replace_input(0, InferInput("A", "INT32", (1, 2, 2**60), raw(np.zeros(6, np.int32))))
    with pytest.raises(InvalidArgumentError, match="input byte size mismatch"):
        validation.validate_inputs(request(inputs), model)


def test_bytes_element_count(model: ModelVersion) -> None:
    framed = memoryview(b"\x01\x00\x00\x00a")
    inputs = replace_input(1, InferInput("S", "BYTES", (1, 2), framed))
    with pytest.raises(
        InvalidArgumentError, match="expected 2 string elements for inference input 'S' for model 'm', got 1"
    ):
        validation.validate_inputs(request(inputs), model)


def test_requested_outputs(model: ModelVersion) -> None:
    assert validation.requested_output_names(request([]), model) == ("X", "Y")
    ask = request([], outputs=(RequestedOutput("Y"), RequestedOutput("X")))
    assert validation.requested_output_names(ask, model) == ("Y", "X")
    with pytest.raises(InvalidArgumentError, match="output 'X' already exists in request"):
        validation.requested_output_names(request([], outputs=(RequestedOutput("X"), RequestedOutput("X"))), model)
    with pytest.raises(InvalidArgumentError, match="unexpected inference output 'Q' for model 'm'"):
        validation.requested_output_names(request([], outputs=(RequestedOutput("Q"),)), model)


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"triton_anything": 1}, "parameter keys starting with 'triton_' are reserved"),
        ({"priority": -1}, "'priority' must be a non-negative integer"),
        ({"timeout": True}, "'timeout' must be a non-negative integer"),
        ({"sequence_start": 1}, "'sequence_start' must be a boolean"),
        ({"sequence_id": 1.5}, "'sequence_id' must be an unsigned integer or a string"),
    ],
)
def test_parameters(parameters: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        validation.check_parameters(parameters)


def test_custom_parameters_pass() -> None:
    validation.check_parameters({"sequence_id": "abc", "priority": 2, "timeout": 10, "custom": "x", "flag": True})


def test_shared_memory_inputs_need_a_reader_and_classification_a_count(model: ModelVersion) -> None:
    inputs = replace_input(0, InferInput("A", "INT32", (1, 2, 3), memoryview(b""), {"shared_memory_region": "r"}))
    with pytest.raises(UnsupportedError, match="input 'A': shared memory is not supported"):
        validation.validate_inputs(request(inputs), model)
    for count in (0, -1, True, "2"):
        asks = request([], outputs=(RequestedOutput("X", {"classification": count}),))
        with pytest.raises(InvalidArgumentError, match="'classification' of output 'X' must be a positive integer"):
            validation.requested_output_names(asks, model)
    both = request([], outputs=(RequestedOutput("X", {"classification": 2, "shared_memory_region": "r"}),))
    with pytest.raises(InvalidArgumentError, match="classification can not be used with shared memory"):
        validation.requested_output_names(both, model)


class Regions:
    """Client shared memory as validation reads it: one region, "r", holding 0..5 as INT32; what was read or located
    is recorded."""

    def __init__(self) -> None:
        self.reads: list[str] = []
        self.located: list[str] = []

    def read(self, parameters: Parameters, what: str, check: Callable[[int], None] | None = None) -> memoryview:
        size = parameters["shared_memory_byte_size"]
        assert check is not None and isinstance(size, int)
        check(size)  # as the region does, once its bounds are checked
        self.reads.append(what)
        return raw(np.arange(6, dtype=np.int32))

    def locate(self, parameters: Parameters, what: str, check: Callable[[int], None] | None = None) -> SharedTensor:
        size = parameters["shared_memory_byte_size"]
        assert check is not None and isinstance(size, int)
        check(size)
        self.located.append(what)
        return SharedTensor("UINT8", (size,), Residency(Kind.CLIENT, "r", 64, size))


def test_shared_memory_is_read_only_for_a_checked_input_of_the_tensors_size(model: ModelVersion) -> None:
    regions = Regions()

    def in_region(name: str, datatype: str, shape: tuple[int, ...], byte_size: int) -> list[InferInput]:
        parameters: Parameters = {"shared_memory_region": "r", "shared_memory_byte_size": byte_size}
        return replace_input(0, InferInput(name, datatype, shape, memoryview(b""), parameters))

    refused = [
        (in_region("A", "INT32", (1, 2, 3), 1 << 30), "input byte size mismatch for input 'A'"),  # a sparse GiB
        (in_region("A", "FP32", (1, 2, 3), 24), "data-type is 'FP32'"),
        (in_region("A", "INT32", (1, 3, 3), 36), "unexpected shape for input 'A'"),
        (in_region("Z", "INT32", (1, 2, 3), 24), "unexpected inference input 'Z'"),
    ]
    for inputs, message in refused:
        with pytest.raises(InvalidArgumentError, match=message):
            validation.validate_inputs(request(inputs), model, regions)
        # Placed in shared memory (the front door), a region's input is located, not read: checked all the same.
        with pytest.raises(InvalidArgumentError, match=message):
            validation.validate_inputs(request(inputs), model, regions, place=placed)
    assert regions.reads == [] and regions.located == []
    tensors = validation.validate_inputs(request(in_region("A", "INT32", (1, 2, 3), 24)), model, regions)
    assert regions.reads == ["input 'A'"] and tensors["A"].array[0, 1, 2] == 5
    located = validation.validate_inputs(request(in_region("A", "INT32", (1, 2, 3), 24)), model, regions, place=placed)
    assert regions.reads == ["input 'A'"] and regions.located == ["input 'A'"]
    tensor = located["A"]
    assert (tensor.datatype, tensor.shape) == ("INT32", (1, 2, 3))
    assert tensor.where == Residency(Kind.CLIENT, "r", 64, 24)  # left where it lies, for the worker to read


def placed(datatype: str, shape: tuple[int, ...], data: memoryview | np.ndarray) -> SharedTensor:
    """A stand-in for the front door's placement: where the bytes would go does not matter here."""
    return SharedTensor.zeros(datatype, shape)


def test_bytes_element_limit_is_checked_from_the_shape_before_any_decode(model: ModelVersion) -> None:
    inputs = good_inputs(3)
    inputs[1] = InferInput("S", "BYTES", (3, 2), memoryview(b"\xff" * 3))  # would not even frame
    with pytest.raises(InvalidArgumentError, match="input 'S' for model 'm' has 6 BYTES elements, more than the 5"):
        validation.validate_inputs(request(inputs), model, max_bytes_elements=5)
    assert validation.validate_inputs(request(good_inputs(2)), model, max_bytes_elements=4)["S"].shape == (2, 2)


def test_decode_cost_counts_bytes_framing_and_shared_memory_only() -> None:
    inputs = [
        InferInput("S", "BYTES", (1,), memoryview(b"\x01\x00\x00\x00a")),
        InferInput("A", "INT32", (4,), raw(np.zeros(4, np.int32))),
        InferInput("R", "FP32", (4,), memoryview(b""), {"shared_memory_region": "r", "shared_memory_byte_size": 16}),
        InferInput("T", "BYTES", (1,), np.array([b"a"], dtype=object)),
    ]
    assert validation.decode_cost(request(inputs)) == 5 + 16
