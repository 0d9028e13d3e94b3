"""A model config completed from, and checked against, the `.om` description."""

from __future__ import annotations

from typing import Any

from geserve._generated import model_config_pb2 as mc
from geserve.backends.acl import names
from geserve.backends.acl.description import OmDescription, OmTensor
from geserve.backends.completion import complete_tensors
from geserve.errors import ModelLoadError
from geserve.repository import sequence


def complete(config: mc.ModelConfig, om: OmDescription, auto_complete: bool, model_file: str) -> dict[str, OmTensor]:
    """Fill what the config leaves out (with `auto_complete`), then refuse a config the `.om` contradicts.
    Returns the `.om` output each config output name stands for."""
    for tensor in (*om.inputs, *om.outputs):
        if tensor.datatype is None or tensor.datatype.itemsize is None:
            raise ModelLoadError(
                f"model '{config.name}': tensor '{tensor.name}' of '{model_file}' has aclDataType "
                f"{tensor.acl_type}, which geserve cannot serve"
            )
    if auto_complete:
        _auto_complete(config, om, model_file)
    return check(config, om, model_file)


def _auto_complete(config: mc.ModelConfig, om: OmDescription, model_file: str) -> None:
    if config.max_batch_size == 0 and om.rows and (not config.input or _inputs_leave_out_the_batch(config, om)):
        config.max_batch_size = om.rows
    if config.max_batch_size > 0 and om.rows:
        if config.WhichOneof("scheduling_choice") is None:
            config.dynamic_batching.SetInParent()
        batching = config.dynamic_batching if config.HasField("dynamic_batching") else None
        if batching is not None and not batching.preferred_batch_size:
            sizes = om.gears or (om.rows,)
            batching.preferred_batch_size.extend(size for size in sizes if size <= config.max_batch_size)
    skip = 1 if config.max_batch_size > 0 else 0
    # Control and state tensors are the sequence batcher's, never the client's.
    served, kept = sequence.control_and_state_inputs(config), sequence.state_outputs(config)
    if not config.input:
        for tensor in om.inputs:
            if tensor.name not in served:
                config.input.add(name=tensor.name)
    if not config.output:
        full_names = [tensor.name for tensor in om.outputs if tensor.name not in kept]
        for full, shown in zip(full_names, names.shortest_unique(full_names), strict=True):
            config.output.add(name=shown)
            if shown != full:
                config.parameters[names.FULL_NAME_PARAMETER.format(shown)].string_value = full
    inputs = {tensor.name: tensor for tensor in om.inputs}
    complete_tensors(config.input, inputs.get, skip)
    outputs = {tensor.name: tensor for tensor in om.outputs}
    full_names = list(outputs)

    def output(name: str) -> OmTensor:
        return outputs[names.resolve(name, full_names, config.name, model_file)]

    complete_tensors(config.output, output, skip)


def _inputs_leave_out_the_batch(config: mc.ModelConfig, om: OmDescription) -> bool:
    """A config without max_batch_size whose input dims are the model's without its batch dim (as
    configs written for Triton's GE backend are): the model batches."""
    by_name = {tensor.name: tensor for tensor in om.inputs}
    declared = [(tensor, by_name.get(tensor.name)) for tensor in config.input]
    return all(
        found is not None and len(found.dims) > 1 and list(tensor.dims) == list(found.dims[1:])
        for tensor, found in declared
    )


def check(config: mc.ModelConfig, om: OmDescription, model_file: str) -> dict[str, OmTensor]:
    """Refuse a config the `.om` contradicts; the `.om` output behind each config output."""
    name = config.name
    if config.max_batch_size > 0:
        if not om.rows:
            raise ModelLoadError(
                f"model '{name}': config max_batch_size {config.max_batch_size} asks for batching, but "
                f"'{model_file}' has neither batch gears nor a common fixed batch dim"
            )
        if config.max_batch_size > om.rows:
            what = (
                f"its largest batch gear is {om.rows} (gears {list(om.gears)})"
                if om.gears
                else (f"it was compiled for a fixed batch of {om.rows}")
            )
            raise ModelLoadError(
                f"model '{name}': config max_batch_size {config.max_batch_size} exceeds what '{model_file}' "
                f"can run: {what}"
            )
    skip = 1 if config.max_batch_size > 0 else 0
    inputs = {tensor.name: tensor for tensor in om.inputs}
    for tensor in config.input:
        om_tensor = inputs.get(tensor.name)
        if om_tensor is None:
            raise ModelLoadError(
                f"model '{name}': config input '{tensor.name}' is not in '{model_file}', whose inputs are "
                f"{sorted(inputs)}"
            )
        _check_tensor(name, "input", tensor, om_tensor, skip=skip, model_file=model_file)
    outputs = {tensor.name: tensor for tensor in om.outputs}
    matched: dict[str, OmTensor] = {}
    for output in config.output:
        om_output = outputs[names.resolve(output.name, list(outputs), name, model_file)]
        _check_tensor(name, "output", output, om_output, skip=skip, model_file=model_file)
        matched[output.name] = om_output
    served = sequence.control_and_state_inputs(config)
    for input_name in sorted(served):
        if input_name not in inputs:
            raise ModelLoadError(
                f"model '{name}': sequence batching input '{input_name}' is not in '{model_file}', whose inputs are "
                f"{sorted(inputs)}"
            )
    for state_output in sorted(sequence.state_outputs(config)):
        if state_output not in matched:
            matched[state_output] = outputs[names.resolve(state_output, list(outputs), name, model_file)]
    missing = sorted(set(inputs) - {t.name for t in config.input} - served)
    if missing:
        raise ModelLoadError(f"model '{name}': inputs {missing} of '{model_file}' are missing from the config")
    return matched


def _check_tensor(model: str, kind: str, tensor: Any, om_tensor: OmTensor, *, skip: int, model_file: str) -> None:
    datatype = om_tensor.datatype
    assert datatype is not None
    label = tensor.name if tensor.name == om_tensor.name else f"{tensor.name}' ('{om_tensor.name}"
    if tensor.data_type != datatype.config:
        raise ModelLoadError(
            f"model '{model}': config {kind} '{label}' has data type {mc.DataType.Name(tensor.data_type)}, "
            f"but '{model_file}' declares {datatype.config_name}"
        )
    om_dims = list(om_tensor.dims[skip:])
    config_dims = list(tensor.reshape.shape) if tensor.HasField("reshape") else list(tensor.dims)
    if config_dims != om_dims:
        batch = " after the batch dim" if skip else ""
        raise ModelLoadError(
            f"model '{model}': config {kind} '{label}' has dims {list(tensor.dims)}, but '{model_file}' "
            f"declares {list(om_tensor.dims)} ({om_dims}{batch})"
        )
