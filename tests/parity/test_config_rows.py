"""Each config row holds: a refused field fails the load naming it; any other field set loads."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from google.protobuf import descriptor, text_format

from geserve._generated import model_config_pb2 as mc
from geserve.core.loader import prepare_model
from geserve.errors import ModelLoadError
from geserve.repository import config as config_io
from geserve.repository.scan import ModelSource
from geserve.settings import WorkerSettings
from geserve.workers.pool import InstancePools
from tests.parity.proof import check_test_file
from tests.parity.table import Row, rows_of

MODEL = "parity"
BASE = f"""
name: "{MODEL}"
backend: "identity"
max_batch_size: 8
input [{{ name: "INPUT0" data_type: TYPE_FP32 dims: [4] }}]
output [{{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [4] }}]
"""
SEQUENCE_STATE = """
sequence_batching {
  state [{ input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_FP32 dims: [1]
           initial_state [{ name: "zeros" data_type: TYPE_FP32 dims: [1] zero_data: true }] }]
}
"""
ENSEMBLE = f"""
name: "{MODEL}"
platform: "ensemble"
max_batch_size: 8
input [{{ name: "IN" data_type: TYPE_FP32 dims: [4] }}]
output [{{ name: "OUT" data_type: TYPE_FP32 dims: [4] }}]
ensemble_scheduling {{
  step [{{ model_name: "inner" model_version: -1 input_map {{ key: "INPUT0" value: "IN" }}
          output_map {{ key: "OUTPUT0" value: "OUT" }} }}]
}}
"""
# Ragged batches are a python-model feature (other backends refuse them at load).
RAGGED_PYTHON = f"""
name: "{MODEL}"
backend: "python"
max_batch_size: 8
dynamic_batching {{ }}
input [{{ name: "INPUT0" data_type: TYPE_FP32 dims: [-1] allow_ragged_batch: true }}]
output [{{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [-1] }}]
"""
PYTHON_MODEL = "class TritonPythonModel:\n    def execute(self, requests):\n        return []\n"
# Where setting the one field alone would not make a config Triton loads, the whole config that uses it.
EXAMPLES = {
    "name": BASE,
    "input": BASE,
    "output": BASE,
    "version_policy.specific": BASE + "version_policy { specific { versions: [1] } }",
    "platform": ENSEMBLE,
    "ensemble_scheduling": ENSEMBLE,
    "ensemble_scheduling.step": ENSEMBLE,
    "ensemble_scheduling.step.input_map": ENSEMBLE,
    "ensemble_scheduling.step.output_map": ENSEMBLE,
    "backend": BASE,
    "input.allow_ragged_batch": RAGGED_PYTHON,
    "dynamic_batching.default_priority_level": BASE
    + "dynamic_batching { priority_levels: 2 default_priority_level: 2 }",
    "dynamic_batching.priority_queue_policy": BASE
    + "dynamic_batching { priority_levels: 2 priority_queue_policy { key: 1 value { max_queue_size: 4 } } }",
    "sequence_batching.control_input.*": BASE
    + 'sequence_batching { control_input [{ name: "START" control [{ kind: CONTROL_SEQUENCE_START '
    "int32_false_true: [0, 1] }] }] }",
    "sequence_batching.state": BASE + SEQUENCE_STATE,
    "sequence_batching.state.input_name": BASE + SEQUENCE_STATE,
    "sequence_batching.state.output_name": BASE + SEQUENCE_STATE,
    "sequence_batching.state.data_type": BASE + SEQUENCE_STATE,
    "sequence_batching.state.dims": BASE + SEQUENCE_STATE,
    "sequence_batching.state.initial_state.*": BASE + SEQUENCE_STATE,
    "sequence_batching.state.use_same_buffer_for_input_output": BASE
    + SEQUENCE_STATE.replace("dims: [1]\n", "dims: [1] use_same_buffer_for_input_output: true\n", 1),
    "sequence_batching.state.use_growable_memory": BASE
    + SEQUENCE_STATE.replace("dims: [1]\n", "dims: [1] use_growable_memory: true\n", 1),
}
PARAMETER_VALUES = {"execute_delay_ms": "1", "intra_op_thread_count": "1", "inter_op_thread_count": "1"}


def _sample(field: descriptor.FieldDescriptor) -> object:
    """A value other than the field's default."""
    if field.type == descriptor.FieldDescriptor.TYPE_BOOL:
        return True
    if field.type == descriptor.FieldDescriptor.TYPE_ENUM:
        return field.enum_type.values[-1].number
    if field.type == descriptor.FieldDescriptor.TYPE_STRING:
        return "x"
    if field.type in (descriptor.FieldDescriptor.TYPE_FLOAT, descriptor.FieldDescriptor.TYPE_DOUBLE):
        return 0.5
    return 1


def _repeated(field: descriptor.FieldDescriptor) -> bool:
    # protobuf 6 deprecates `label` for `is_repeated`; older releases have only `label`.
    if hasattr(field, "is_repeated"):
        return bool(field.is_repeated)
    return bool(field.label == descriptor.FieldDescriptor.LABEL_REPEATED)


def with_field(key: str) -> mc.ModelConfig:
    """The base config with the row's field set to a value other than its default (or the row's example)."""
    config = mc.ModelConfig()
    if key in EXAMPLES:
        text_format.Parse(EXAMPLES[key], config)
        return config
    text_format.Parse(ENSEMBLE if key.startswith("ensemble_scheduling") else BASE, config)
    path, _, map_key = key.removesuffix(".*").partition("[")
    map_key = map_key.rstrip("]") or "k"
    message = config
    parts = path.split(".")
    for index, name in enumerate(parts):
        field = message.DESCRIPTOR.fields_by_name[name]
        last = index == len(parts) - 1
        container = getattr(message, name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            if field.message_type.fields_by_name["key"].type != descriptor.FieldDescriptor.TYPE_STRING:
                message.priority_levels = message.priority_levels or 2  # a level's policy needs the level
                container = getattr(message, name)
                map_key = 1  # type: ignore[assignment]
            if value_field.message_type is None:
                container[map_key] = _sample(value_field)
                continue
            message = container[map_key]
            if last and value_field.message_type.name == "ModelParameter":
                message.string_value = PARAMETER_VALUES.get(map_key, "x")
        elif _repeated(field) and field.message_type is not None:
            message = container[0] if len(container) else container.add()
            if last and field.message_type.fields and field.message_type.fields[0].name == "name":
                message.name = message.name or "x"
        elif _repeated(field):
            container.append(_sample(field))
        elif field.message_type is not None:
            container.SetInParent()
            message = container
        else:
            setattr(message, name, _sample(field))
    return config


def load(config: mc.ModelConfig, tmp_path: Path) -> None:
    """geserve's load path up to starting workers: config file, defaults, backend, validation."""
    folder = tmp_path / MODEL
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(text_format.MessageToString(config), encoding="utf-8")
    if config.backend == "python":
        (folder / "1" / "model.py").write_text(PYTHON_MODEL, encoding="utf-8")
    prepared, _ = prepare_model(ModelSource(MODEL, folder), InstancePools(WorkerSettings()))
    config_io.validate_config(prepared)


def _id(row: Row) -> str:
    return row.key


@pytest.mark.parametrize("row", [row for row in rows_of("config") if row.status == "refused"], ids=_id)
def test_refused_field_fails_the_load_naming_it(row: Row, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as error:
        load(with_field(row.key), tmp_path / "refused")
    named = row.key.removesuffix(".*").rsplit(".", 1)[-1].split("[")[-1].rstrip("]")
    assert named in error.value.message
    assert re.search(r"not (supported|available)", error.value.message), error.value.message
    load(with_field("backend"), tmp_path / "good")  # the same model without the field loads


@pytest.mark.parametrize("row", [row for row in rows_of("config") if row.status != "refused"], ids=_id)
def test_other_field_loads(row: Row, tmp_path: Path) -> None:
    config = with_field(row.key)
    base = mc.ModelConfig()
    text_format.Parse(ENSEMBLE if row.key.startswith("ensemble_scheduling") else BASE, base)
    assert config != base or row.key in EXAMPLES, "the field was not set"
    load(config, tmp_path)


@pytest.mark.parametrize("row", rows_of("config"), ids=_id)
def test_row_test_file_mentions_the_field(row: Row) -> None:
    check_test_file(row)
