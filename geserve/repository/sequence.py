"""A sequence model's config: its control tensors, implicit states and strategy, checked with Triton's texts."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from geserve._generated import model_config_pb2 as mc
from geserve.codecs import bytes as bytes_codec
from geserve.codecs import dtypes
from geserve.errors import GeserveError, ModelLoadError

Kind = mc.ModelSequenceBatching.Control
# Triton's SEQUENCE_IDLE_DEFAULT_MICROSECONDS, filled into configs that leave it 0.
DEFAULT_IDLE_MICROSECONDS = 1_000_000
# Where a state's initial data_file lives, under the model folder (Triton's kInitialStateFolder).
INITIAL_STATE_FOLDER = "initial_state"
# CORRID control data types a numeric sequence id is accepted for.
_NUMERIC_CORRID = (mc.TYPE_UINT64, mc.TYPE_INT64, mc.TYPE_UINT32, mc.TYPE_INT32)


@dataclass(frozen=True, slots=True)
class BooleanControl:
    """A START, END or READY input: the values the server writes for false and true."""

    name: str
    datatype: dtypes.DataType
    false_value: float | int | bool
    true_value: float | int | bool

    def array(self, flags: list[bool], batched: bool) -> np.ndarray:
        """The control for a batch: one element per request, shaped [n, 1] (or [1] without a batch dimension)."""
        values = np.where(np.array(flags, dtype=bool), self.true_value, self.false_value).astype(self.datatype.numpy)
        return values.reshape(-1, 1) if batched else values.reshape(1)


@dataclass(frozen=True, slots=True)
class CorrelationControl:
    """The CORRID input: the sequence id, as a number or a string."""

    name: str
    datatype: dtypes.DataType

    def array(self, ids: list[int | str], batched: bool) -> np.ndarray:
        if self.datatype.wire == "BYTES":
            values = np.array([str(i).encode() for i in ids], dtype=np.object_)
        else:
            values = np.array([int(i) if isinstance(i, int) else 0 for i in ids], dtype=self.datatype.numpy)
        return values.reshape(-1, 1) if batched else values.reshape(1)

    def holds(self, correlation_id: int) -> bool:
        """Whether a numeric id fits the control's integer type."""
        limits = np.iinfo(self.datatype.numpy.name)
        return int(limits.min) <= correlation_id <= int(limits.max)

    def accepts(self, correlation_id: int | str) -> bool:
        numeric = self.datatype.wire != "BYTES"
        return isinstance(correlation_id, int) == numeric


@dataclass(frozen=True, slots=True)
class StateSpec:
    """One implicit state: the input fed each step, the output kept for the next, and its value at START."""

    input_name: str
    output_name: str
    datatype: dtypes.DataType
    initial: np.ndarray  # one request's state, with the batch dimension when the model batches


@dataclass(frozen=True, slots=True)
class SequenceSettings:
    """How a sequence model is scheduled (from its sequence_batching)."""

    oldest: bool
    idle_ns: int
    slots_per_instance: int
    max_batch_size: int
    start: BooleanControl | None
    end: BooleanControl | None
    ready: BooleanControl | None
    correlation: CorrelationControl | None
    # direct: wait up to this long for minimum_slot_utilization; oldest: max_queue_delay_microseconds.
    max_delay_ns: int
    minimum_slot_utilization: float
    preferred_sizes: tuple[int, ...]
    # oldest: responses leave each instance in the order its requests were dispatched to it.
    preserve_ordering: bool = False

    @property
    def batched(self) -> bool:
        return self.max_batch_size > 0

    def control_names(self) -> tuple[str, ...]:
        controls = (self.start, self.end, self.ready, self.correlation)
        return tuple(control.name for control in controls if control is not None)


def fill_defaults(config: mc.ModelConfig) -> None:
    """What Triton fills into a sequence_batching before it reports the config."""
    if not config.HasField("sequence_batching"):
        return
    batching = config.sequence_batching
    if batching.max_sequence_idle_microseconds == 0:
        batching.max_sequence_idle_microseconds = DEFAULT_IDLE_MICROSECONDS
    if batching.HasField("oldest") and not batching.oldest.preferred_batch_size and config.max_batch_size > 0:
        batching.oldest.preferred_batch_size.append(config.max_batch_size)


def control_and_state_inputs(config: mc.ModelConfig) -> set[str]:
    """Inputs the server fills itself: they are not in `input` and clients never send them."""
    if not config.HasField("sequence_batching"):
        return set()
    batching = config.sequence_batching
    return {control.name for control in batching.control_input} | {state.input_name for state in batching.state}


def state_outputs(config: mc.ModelConfig) -> set[str]:
    if not config.HasField("sequence_batching"):
        return set()
    return {state.output_name for state in config.sequence_batching.state}


def settings_of(config: mc.ModelConfig) -> SequenceSettings:
    """The sequence settings of a config that has sequence_batching; raises ModelLoadError."""
    name = config.name
    batching = config.sequence_batching
    _check_control_inputs(batching, name)
    oldest = batching.HasField("oldest")
    slots = max(1, config.max_batch_size)
    if oldest and batching.oldest.max_candidate_sequences > 0:
        slots = batching.oldest.max_candidate_sequences
    if oldest:
        delay_us = batching.oldest.max_queue_delay_microseconds
        preferred = tuple(sorted(set(batching.oldest.preferred_batch_size)))
    else:
        delay_us, preferred = batching.direct.max_queue_delay_microseconds, ()
    idle_us = batching.max_sequence_idle_microseconds or DEFAULT_IDLE_MICROSECONDS
    return SequenceSettings(
        oldest=oldest,
        idle_ns=idle_us * 1000,
        slots_per_instance=slots,
        max_batch_size=config.max_batch_size,
        start=_boolean_control(batching, name, Kind.CONTROL_SEQUENCE_START),
        end=_boolean_control(batching, name, Kind.CONTROL_SEQUENCE_END),
        ready=_boolean_control(batching, name, Kind.CONTROL_SEQUENCE_READY),
        correlation=_correlation_control(batching, name),
        max_delay_ns=delay_us * 1000,
        minimum_slot_utilization=0.0 if oldest else float(batching.direct.minimum_slot_utilization),
        preferred_sizes=preferred,
        preserve_ordering=oldest and batching.oldest.preserve_ordering,
    )


def _check_control_inputs(batching: mc.ModelSequenceBatching, model: str) -> None:
    seen: set[str] = set()
    kinds: set[int] = set()
    for control_input in batching.control_input:
        if not control_input.name:
            raise ModelLoadError(f"sequence batching control tensor must have a name for {model}")
        if control_input.name in seen:
            raise ModelLoadError(
                f"sequence batching control tensor '{control_input.name}' is specified for multiple control kinds "
                f"for {model}"
            )
        seen.add(control_input.name)
        for control in control_input.control:
            if control.kind in kinds:
                raise ModelLoadError(
                    f"sequence batching specifies multiple {Kind.Kind.Name(control.kind)} tensors for {model}"
                )
            kinds.add(control.kind)


def _find(batching: mc.ModelSequenceBatching, kind: int) -> tuple[str, mc.ModelSequenceBatching.Control] | None:
    for control_input in batching.control_input:
        for control in control_input.control:
            if control.kind == kind:
                return control_input.name, control
    return None


def _boolean_control(batching: mc.ModelSequenceBatching, model: str, kind: int) -> BooleanControl | None:
    found = _find(batching, kind)
    if found is None:
        return None
    name, control = found
    kind_name = Kind.Kind.Name(kind)  # type: ignore[arg-type]
    given = [
        (field, values)
        for field, values in (
            ("int32_false_true", list(control.int32_false_true)),
            ("fp32_false_true", list(control.fp32_false_true)),
            ("bool_false_true", list(control.bool_false_true)),
        )
        if values
    ]
    if not given:
        raise ModelLoadError(
            "sequence batching must specify either 'int32_false_true', 'fp32_false_true' or 'bool_false_true' "
            f"for {kind_name} for {model}"
        )
    if len(given) > 1:
        raise ModelLoadError(
            f"sequence batching specifies both '{given[0][0]}' and '{given[1][0]}' for {kind_name} for {model}"
        )
    field, values = given[0]
    if len(values) != 2:
        raise ModelLoadError(
            f"sequence batching control '{field}' must have exactly 2 entries for {kind_name} for {model}"
        )
    config_type = {"int32_false_true": mc.TYPE_INT32, "fp32_false_true": mc.TYPE_FP32}.get(field, mc.TYPE_BOOL)
    return BooleanControl(name, dtypes.from_config(config_type), values[0], values[1])


def _correlation_control(batching: mc.ModelSequenceBatching, model: str) -> CorrelationControl | None:
    found = _find(batching, Kind.CONTROL_SEQUENCE_CORRID)
    if found is None:
        return None
    name, control = found
    if control.int32_false_true or control.fp32_false_true or control.bool_false_true:
        raise ModelLoadError(
            "sequence batching must not specify either 'int32_false_true', 'fp32_false_true' or 'bool_false_true' "
            f"for CONTROL_SEQUENCE_CORRID for {model}"
        )
    if control.data_type not in (*_NUMERIC_CORRID, mc.TYPE_STRING):
        raise ModelLoadError(
            f"sequence batching control 'CONTROL_SEQUENCE_CORRID' for {model} must have data_type TYPE_UINT64, "
            "TYPE_INT64, TYPE_UINT32, TYPE_INT32 or TYPE_STRING"
        )
    return CorrelationControl(name, dtypes.from_config(control.data_type))


def read_states(config: mc.ModelConfig, model_dir: Path) -> tuple[StateSpec, ...]:
    """The config's implicit states with their initial values (zeros, or read from initial_state/); raises
    ModelLoadError with Triton's texts."""
    if not config.HasField("sequence_batching"):
        return ()
    batched = config.max_batch_size > 0
    specs: list[StateSpec] = []
    seen: set[str] = set()
    for state in config.sequence_batching.state:
        if not state.input_name or not state.output_name:
            raise ModelLoadError(f"model '{config.name}': a sequence_batching state must name its input and output")
        if state.data_type == mc.TYPE_INVALID:
            raise ModelLoadError(f"model '{config.name}': state '{state.input_name}' must specify 'data_type'")
        if state.input_name in seen:
            raise ModelLoadError(f"State input name '{state.input_name}' specified more than once.")
        seen.add(state.input_name)
        datatype = dtypes.from_config(state.data_type)
        if len(state.initial_state) > 1:
            raise ModelLoadError(
                f"initial_state field for state input '{state.input_name}' must contain exactly one or zero element. "
                f"Found '{len(state.initial_state)}' elements."
            )
        if state.initial_state:
            initial = _initial_data(state, state.initial_state[0], datatype, model_dir)
        else:
            # No initial_state: the first step sees zeros, variable dimensions taken as 1.
            initial = np.zeros(tuple(d if d > 0 else 1 for d in state.dims), dtype=datatype.numpy)
            if datatype.wire == "BYTES":
                initial = np.full(initial.shape, b"", dtype=np.object_)
        if batched:
            initial = initial.reshape((1, *initial.shape))
        specs.append(StateSpec(state.input_name, state.output_name, datatype, initial))
    return tuple(specs)


def _initial_data(
    state: mc.ModelSequenceBatching.State,
    initial: mc.ModelSequenceBatching.InitialState,
    datatype: dtypes.DataType,
    model_dir: Path,
) -> np.ndarray:
    name = state.input_name
    if initial.data_type != state.data_type:
        raise ModelLoadError(
            f"The data type used for 'initial_state' field of state '{name}' does not match the state data type."
        )
    if not initial.name:
        raise ModelLoadError(f"Field 'name' must be set when using initial_state for state input '{name}'.")
    if len(initial.dims) != len(state.dims):
        raise ModelLoadError(
            "Number of dimensions in 'initial_state' doesn't match the size of 'state' dimensions for state input "
            f"'{name}'. {len(initial.dims)} != {len(state.dims)}"
        )
    for given, declared in zip(initial.dims, state.dims, strict=True):
        if given == -1:
            raise ModelLoadError(f"'initial_state' field for state input name '{name}' contains variable dimensions.")
        if declared != -1 and given != declared:
            raise ModelLoadError(
                f"'initial_state' dim for input name '{name}' doesn't match 'state' dim description. "
                f"{given} != {declared}"
            )
    shape = tuple(initial.dims)
    if initial.WhichOneof("state_data") != "data_file":
        if datatype.wire == "BYTES":
            return np.full(shape, b"", dtype=np.object_)
        return np.zeros(shape, dtype=datatype.numpy)
    path = model_dir / INITIAL_STATE_FOLDER / initial.data_file
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ModelLoadError(f"failed to read initial state of '{name}' from {path}: {error}") from None
    if datatype.wire == "BYTES":
        return _strings(data, math.prod(shape), name).reshape(shape)
    expected = math.prod(shape) * (datatype.itemsize or 0)
    if expected > len(data):
        raise ModelLoadError(
            f"initial_state setting expects {expected} bytes, but the data provided from {initial.data_file} only "
            f"has {len(data)} bytes."
        )
    return np.frombuffer(data[:expected], dtype=datatype.numpy.newbyteorder("<")).astype(datatype.numpy).reshape(shape)


def _strings(data: bytes, count: int, name: str) -> np.ndarray:
    try:
        strings = bytes_codec.deserialize(memoryview(data), count)
    except GeserveError as error:
        raise ModelLoadError(f"initial state of '{name}': {error.message}") from None
    if len(strings) != count:
        raise ModelLoadError(f"initial state of '{name}' holds {len(strings)} strings, its dims need {count}")
    return strings
