"""config.pbtxt parsing with protobuf text_format, Triton's defaults, checks and JSON form."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from google.protobuf import descriptor, json_format, text_format

from geserve._generated import model_config_pb2 as mc
from geserve.errors import ModelLoadError
from geserve.repository import ragged, sequence

ModelConfig = mc.ModelConfig
CONFIG_FILENAME = "config.pbtxt"
CUSTOM_CONFIG_FOLDER = "configs"  # --model-config-name's configs/<name>.pbtxt
_INT64_TYPES = {
    descriptor.FieldDescriptor.TYPE_INT64,
    descriptor.FieldDescriptor.TYPE_UINT64,
    descriptor.FieldDescriptor.TYPE_SINT64,
    descriptor.FieldDescriptor.TYPE_FIXED64,
    descriptor.FieldDescriptor.TYPE_SFIXED64,
}


def parse_config_text(text: str, source: str) -> mc.ModelConfig:
    """Parse config.pbtxt text; a syntax error names the file, line and column."""
    config = mc.ModelConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as error:
        line, column = error.GetLine(), error.GetColumn()
        reason = str(error).split(" : ", 1)[-1]
        raise ModelLoadError(f"failed to parse {source} at line {line} column {column}: {reason}") from None
    return config


def config_path(model_dir: Path, config_name: str = "") -> Path:
    """The model's config file: with --model-config-name, `configs/<name>.pbtxt` where the folder has it, else
    config.pbtxt, as Triton's GetModelConfigFullPath chooses."""
    if config_name:
        chosen = model_dir / CUSTOM_CONFIG_FOLDER / f"{config_name}.pbtxt"
        if chosen.is_file():
            return chosen
    return model_dir / CONFIG_FILENAME


def read_model_config(model_dir: Path, model_name: str, config_name: str = "") -> tuple[mc.ModelConfig, bool]:
    """The model's config file (`config_path`), or an empty config when there is none; and whether a file
    existed."""
    path = config_path(model_dir, config_name)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return mc.ModelConfig(name=model_name), False
    except (OSError, UnicodeDecodeError) as error:
        raise ModelLoadError(f"failed to read {path}: {error}") from None
    config = parse_config_text(text, str(path))
    if config.name and config.name != model_name:
        raise ModelLoadError(
            f"unexpected 'name' in model configuration {path}: expected '{model_name}', got '{config.name}'"
        )
    config.name = model_name
    return config, True


def fill_defaults(config: mc.ModelConfig, backend: str, default_filename: str, device_kind: int) -> None:
    """Fill the fields Triton fills before it reports a config (backend, policy, instances, ...)."""
    if not config.backend:
        config.backend = backend
    if not config.HasField("version_policy"):
        config.version_policy.latest.num_versions = 1
    if not config.default_model_filename:
        config.default_model_filename = default_filename
    # Triton's names (core model_config_utils.cc NormalizeInstanceGroup): the group it adds to a config without one is
    # named after the model, a group the config leaves unnamed `<model>_<its index>`.
    if not config.instance_group:
        config.instance_group.add().name = config.name
    for index, group in enumerate(config.instance_group):
        if not group.name:
            group.name = f"{config.name}_{index}"
        if group.kind == mc.ModelInstanceGroup.KIND_AUTO:
            group.kind = device_kind  # type: ignore[assignment]
        group.count = max(group.count, 1)
    if not config.HasField("optimization"):
        config.optimization.input_pinned_memory.enable = True
        config.optimization.output_pinned_memory.enable = True
    if not config.HasField("model_transaction_policy"):
        config.model_transaction_policy.decoupled = False
    sequence.fill_defaults(config)


# Each instance is a process: a config asking for more in one group is refused before any starts.
MAX_INSTANCES_PER_GROUP = 64


def refuse_unsupported(config: mc.ModelConfig) -> None:
    """Fields geserve cannot honour (TensorRT-only tensor properties, another backend library), instance
    counts no machine could start, and KIND_MODEL groups that name devices (Triton's check) fail the load at
    once, before any worker starts."""
    name = config.name
    for group in config.instance_group:
        if group.kind == mc.ModelInstanceGroup.KIND_MODEL and group.gpus:
            raise ModelLoadError(
                f"instance group {group.name or name} of model {name} has kind KIND_MODEL but specifies one or "
                "more GPUs"
            )
        if not 0 <= group.count <= MAX_INSTANCES_PER_GROUP:
            raise ModelLoadError(
                f"instance group '{group.name or name}' of model '{name}' asks for {group.count} instances; "
                f"count must be between 1 and {MAX_INSTANCES_PER_GROUP}"
            )
    _refuse_runtime(config)
    for kind, tensors in (("input", config.input), ("output", config.output)):
        for tensor in tensors:
            # Both are TensorRT engine properties (shape tensors, non-linear I/O formats); no geserve backend
            # has them, so a config relying on them cannot run as written.
            if tensor.is_shape_tensor:
                raise ModelLoadError(
                    f"model '{name}' {kind} '{tensor.name}': is_shape_tensor is not supported by geserve: shape "
                    "tensors are a TensorRT feature and no geserve backend has them"
                )
            if tensor.is_non_linear_format_io:
                raise ModelLoadError(
                    f"model '{name}' {kind} '{tensor.name}': is_non_linear_format_io is not supported by geserve: "
                    "non-linear I/O formats are a TensorRT feature and no geserve backend has them"
                )


# Triton's platform names whose backend geserve has under another name.
_PLATFORM_BACKENDS = {"onnxruntime_onnx": "onnxruntime"}


def _refuse_runtime(config: mc.ModelConfig) -> None:
    """`runtime` names the backend library Triton loads; geserve's backends are built in, so only the name of
    the library the config's own backend would load (or none) means what the user expects."""
    if not config.runtime:
        return
    backend = config.backend or _PLATFORM_BACKENDS.get(config.platform, config.platform)
    expected = f"libtriton_{backend}.so" if backend else ""
    if config.runtime != expected:
        choice = f"leave it empty or set '{expected}'" if expected else "leave it empty"
        raise ModelLoadError(
            f"model '{config.name}': runtime '{config.runtime}' is not supported: geserve's backends are built in "
            f"and it cannot load another backend library; {choice}"
        )


def validate_config(config: mc.ModelConfig) -> None:
    """Reject configs that cannot be served, with a message naming the model and field."""
    name = config.name
    if config.max_batch_size < 0:
        raise ModelLoadError(f"model '{name}': max_batch_size must be >= 0, got {config.max_batch_size}")
    refuse_unsupported(config)
    if not config.output:
        raise ModelLoadError(f"model '{name}' must specify at least one output")
    for kind, tensors in (("input", config.input), ("output", config.output)):
        seen: set[str] = set()
        for tensor in tensors:
            if not tensor.name:
                raise ModelLoadError(f"model '{name}' has an {kind} without a name")
            if tensor.name in seen:
                raise ModelLoadError(f"model '{name}' has more than one {kind} named '{tensor.name}'")
            seen.add(tensor.name)
            if tensor.data_type == mc.TYPE_INVALID:
                raise ModelLoadError(f"model '{name}' {kind} '{tensor.name}' must specify 'data_type'")
            for dim in tensor.dims:
                if dim == 0 or dim < -1:
                    raise ModelLoadError(
                        f"model '{name}' {kind} '{tensor.name}' dimension {dim} is invalid: dims must be positive or -1"
                    )
    if config.backend:
        ragged.refuse_unsupported(config)
    if config.HasField("sequence_batching"):
        _validate_sequence(config)
    if config.HasField("dynamic_batching"):
        for size in config.dynamic_batching.preferred_batch_size:
            if size < 1 or size > max(config.max_batch_size, 1):
                raise ModelLoadError(
                    f"model '{name}': preferred_batch_size {size} must be in [1, max_batch_size "
                    f"{config.max_batch_size}]"
                )


def _validate_sequence(config: mc.ModelConfig) -> None:
    """The sequence batcher's controls and states must not clash with the model's declared tensors."""
    name = config.name
    if config.sequence_batching.iterative_sequence:
        raise ModelLoadError(
            f"model '{name}': iterative_sequence (request rescheduling) is not supported by geserve's sequence batcher"
        )
    settings = sequence.settings_of(config)
    declared_inputs = {tensor.name for tensor in config.input}
    for control in settings.control_names():
        if control in declared_inputs:
            raise ModelLoadError(
                f"model '{name}': control input '{control}' is filled by the sequence batcher; remove it from 'input'"
            )
    for state in config.sequence_batching.state:
        if state.input_name in declared_inputs:
            raise ModelLoadError(
                f"model '{name}': state input '{state.input_name}' is fed by the sequence batcher; "
                "remove it from 'input'"
            )
    if settings.oldest:
        for size in config.sequence_batching.oldest.preferred_batch_size:
            if size < 1 or size > max(config.max_batch_size, 1):
                raise ModelLoadError(
                    f"model '{name}': preferred_batch_size {size} must be in "
                    f"[1, max_batch_size {config.max_batch_size}]"
                )


# protobuf < 5.26 names the switch that prints unset scalars including_default_value_fields.
_NEW_DEFAULTS_FLAG = "always_print_fields_with_no_presence" in inspect.signature(json_format.MessageToDict).parameters


def config_to_json(config: mc.ModelConfig) -> dict[str, Any]:
    """ModelConfig as Triton prints it: proto field names, every scalar, enums by name,
    64-bit integers as JSON numbers, unset messages and oneofs left out."""
    if _NEW_DEFAULTS_FLAG:
        data = json_format.MessageToDict(
            config, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
    else:
        data = json_format.MessageToDict(
            config,
            preserving_proto_field_name=True,
            including_default_value_fields=True,  # type: ignore[call-arg]
        )
    return _triton_form(config.DESCRIPTOR, data)


def _triton_form(message_type: descriptor.Descriptor, data: dict[str, Any]) -> dict[str, Any]:
    """Fields in .proto order, as Triton prints them; 64-bit integers (quoted by protobuf's JSON
    mapping) as numbers."""
    for field in message_type.fields:
        if field.name not in data:
            continue
        value = data[field.name]
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            if value_field.message_type is not None:
                data[field.name] = {key: _triton_form(value_field.message_type, item) for key, item in value.items()}
            elif value_field.type in _INT64_TYPES:
                data[field.name] = {key: int(item) for key, item in value.items()}
        elif field.message_type is not None:
            if isinstance(value, list):
                data[field.name] = [_triton_form(field.message_type, item) for item in value]
            else:
                data[field.name] = _triton_form(field.message_type, value)
        elif field.type in _INT64_TYPES:
            data[field.name] = [int(item) for item in value] if isinstance(value, list) else int(value)
    order = {field.name: index for index, field in enumerate(message_type.fields)}
    return dict(sorted(data.items(), key=lambda item: order.get(item[0], len(order))))
