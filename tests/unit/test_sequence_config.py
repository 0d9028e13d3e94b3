"""Sequence configs: controls and states checked with Triton's texts, defaults filled, states kept per slot."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from geserve._generated import model_config_pb2 as mc
from geserve.errors import ModelLoadError
from geserve.repository.config import fill_defaults, parse_config_text, validate_config
from geserve.repository.sequence import read_states, settings_of
from geserve.workers.messages import SEQUENCE_END, SEQUENCE_READY, SEQUENCE_START, RequestInfo
from geserve.workers.states import SlotStates

BASE = """
name: "m" max_batch_size: 4
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
sequence_batching { %s }
"""


def config_of(sequence: str, base: str = BASE) -> mc.ModelConfig:
    return parse_config_text(base % sequence, "config.pbtxt")


def control(name: str, kind: str, values: str) -> str:
    return f'control_input [ {{ name: "{name}" control [ {{ kind: {kind} {values} }} ] }} ]'


@pytest.mark.parametrize(
    ("sequence", "message"),
    [
        (
            control("S", "CONTROL_SEQUENCE_START", "int32_false_true: [ 0, 1 ] fp32_false_true: [ 0, 1 ]"),
            "sequence batching specifies both 'int32_false_true' and 'fp32_false_true' for CONTROL_SEQUENCE_START for m",
        ),
        (
            control("S", "CONTROL_SEQUENCE_START", "int32_false_true: [ 0 ]"),
            "sequence batching control 'int32_false_true' must have exactly 2 entries for CONTROL_SEQUENCE_START for m",
        ),
        (control("S", "CONTROL_SEQUENCE_READY", ""), "must specify either 'int32_false_true', 'fp32_false_true'"),
        (
            control("S", "CONTROL_SEQUENCE_START", "int32_false_true: [ 0, 1 ]")
            + control("T", "CONTROL_SEQUENCE_START", "int32_false_true: [ 0, 1 ]"),
            "sequence batching specifies multiple CONTROL_SEQUENCE_START tensors for m",
        ),
        (
            control("S", "CONTROL_SEQUENCE_START", "int32_false_true: [ 0, 1 ]")
            + control("S", "CONTROL_SEQUENCE_END", "int32_false_true: [ 0, 1 ]"),
            "sequence batching control tensor 'S' is specified for multiple control kinds for m",
        ),
        (control("", "CONTROL_SEQUENCE_END", "int32_false_true: [ 0, 1 ]"), "control tensor must have a name for m"),
        (control("C", "CONTROL_SEQUENCE_CORRID", "data_type: TYPE_FP32"), "must have data_type TYPE_UINT64"),
        (control("INPUT", "CONTROL_SEQUENCE_START", "int32_false_true: [ 0, 1 ]"), "control input 'INPUT' is filled"),
        ("oldest { preferred_batch_size: [ 9 ] }", "preferred_batch_size 9 must be in [1, max_batch_size 4]"),
        ("iterative_sequence: true", "iterative_sequence (request rescheduling) is not supported"),
    ],
)
def test_bad_controls_fail_the_load(sequence: str, message: str) -> None:
    config = config_of(sequence)
    with pytest.raises(ModelLoadError) as caught:
        validate_config(config)
    assert message in caught.value.message


def test_defaults_are_filled_as_triton_fills_them() -> None:
    config = config_of("oldest { max_candidate_sequences: 6 }")
    fill_defaults(config, "onnxruntime", "model.onnx", 2)
    batching = config.sequence_batching
    assert batching.max_sequence_idle_microseconds == 1_000_000
    assert list(batching.oldest.preferred_batch_size) == [4]
    settings = settings_of(config)
    assert settings.oldest and settings.slots_per_instance == 6
    assert settings_of(config_of("")).slots_per_instance == 4


def _state(initial: str) -> str:
    return f'state [ {{ input_name: "IS" output_name: "OS" data_type: TYPE_INT32 dims: [ 2 ] {initial} }} ]'


@pytest.mark.parametrize(
    ("initial", "message"),
    [
        (
            'initial_state { name: "i" data_type: TYPE_FP32 dims: [ 2 ] zero_data: true }',
            "The data type used for 'initial_state' field of state 'IS' does not match the state data type.",
        ),
        (
            "initial_state { data_type: TYPE_INT32 dims: [ 2 ] zero_data: true }",
            "Field 'name' must be set when using initial_state for state input 'IS'.",
        ),
        (
            'initial_state { name: "i" data_type: TYPE_INT32 dims: [ 3 ] zero_data: true }',
            "'initial_state' dim for input name 'IS' doesn't match 'state' dim description. 3 != 2",
        ),
        (
            'initial_state { name: "i" data_type: TYPE_INT32 dims: [ 2, 1 ] zero_data: true }',
            "Number of dimensions in 'initial_state' doesn't match the size of 'state' dimensions",
        ),
        (
            'initial_state { name: "i" data_type: TYPE_INT32 dims: [ 2 ] data_file: "short" }',
            "initial_state setting expects 8 bytes, but the data provided from short only has 4 bytes.",
        ),
        ('initial_state { name: "i" data_type: TYPE_INT32 dims: [ 2 ] data_file: "missing" }', "failed to read"),
    ],
)
def test_bad_initial_states_fail_the_load(tmp_path: Path, initial: str, message: str) -> None:
    (tmp_path / "initial_state").mkdir()
    (tmp_path / "initial_state" / "short").write_bytes(b"\0" * 4)
    with pytest.raises(ModelLoadError) as caught:
        read_states(config_of(_state(initial)), tmp_path)
    assert message in caught.value.message


def test_initial_state_from_a_file_has_the_batch_dimension(tmp_path: Path) -> None:
    (tmp_path / "initial_state").mkdir()
    (tmp_path / "initial_state" / "two").write_bytes(np.array([7, 9], dtype="<i4").tobytes())
    initial = 'initial_state { name: "i" data_type: TYPE_INT32 dims: [ 2 ] data_file: "two" }'
    (spec,) = read_states(config_of(_state(initial)), tmp_path)
    assert spec.initial.tolist() == [[7, 9]]


def test_slot_states_follow_each_sequence(tmp_path: Path) -> None:
    (spec,) = read_states(config_of(_state("")), tmp_path)
    states = SlotStates((spec,))
    ready = SEQUENCE_READY

    def step(requests: list[RequestInfo], outputs: np.ndarray) -> np.ndarray:
        fed = states.feed({}, requests)["IS"]
        whole = {"OS": outputs, "OUTPUT": outputs}
        states.keep_whole(whole, requests)
        assert "OS" not in whole  # nobody asked for the state output
        return fed

    start = RequestInfo(1, ("OUTPUT",), slot=0, sequence_flags=ready | SEQUENCE_START)
    padding = RequestInfo(1, (), slot=1)
    # Step 1: slot 0 starts (initial zeros), slot 1 is padding.
    assert step([start, padding], np.array([[1, 1], [5, 5]], dtype=np.int32)).tolist() == [[0, 0], [0, 0]]
    # Step 2: slot 0 continues with its kept state; the padding's outputs were not kept.
    cont = RequestInfo(1, ("OUTPUT",), slot=0, sequence_flags=ready)
    other = RequestInfo(1, ("OUTPUT",), slot=1, sequence_flags=ready)
    assert step([cont, other], np.array([[2, 2], [3, 3]], dtype=np.int32)).tolist() == [[1, 1], [0, 0]]
    # END drops the slot's state; a START resets it regardless.
    end = RequestInfo(1, ("OUTPUT",), slot=0, sequence_flags=ready | SEQUENCE_END)
    assert step([end, other], np.array([[4, 4], [6, 6]], dtype=np.int32)).tolist() == [[2, 2], [3, 3]]
    again = RequestInfo(1, ("OUTPUT",), slot=0, sequence_flags=ready)
    assert step([again, start._replace(slot=1)], np.zeros((2, 2), dtype=np.int32)).tolist() == [[0, 0], [0, 0]]
