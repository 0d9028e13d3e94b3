"""A model config completed from, and checked against, the `.om` description."""

from __future__ import annotations

from typing import Any

from geserve._generated import model_config_pb2 as mc
from geserve.backends.acl.description import OmDescription, OmTensor
from geserve.errors import ModelLoadError


def complete(config: mc.ModelConfig, om: OmDescription, auto_complete: bool, model_file: str) -> None:
    """Fill what the config leaves out (with `auto_complete`), then refuse a config the `.om` contradicts."""
    for tensor in (*om.inputs, *om.outputs):
        if tensor.datatype is None or tensor.datatype.itemsize is None:
            raise ModelLoadError(
                f"model '{config.name}': tensor '{tensor.name}' of '{model_file}' has aclDataType "
                f"{tensor.acl_type}, which geserve cannot serve"
            )
    if auto_complete:
        _auto_complete(config, om)
    _check(config, om, model_file)


def _auto_complete(config: mc.ModelConfig, om: OmDescription) -> None:
    if config.max_batch_size == 0 and not config.input and om.rows:
        config.max_batch_size = om.rows
    if config.max_batch_size > 0 and om.rows:
        if config.WhichOneof("scheduling_choice") is None:
            config.dynamic_batching.SetInParent()
        batching = config.dynamic_batching if config.HasField("dynamic_batching") else None
        if batching is not None and not batching.preferred_batch_size:
            sizes = om.gears or (om.rows,)
            batching.preferred_batch_size.extend(size for size in sizes if size <= config.max_batch_size)
    skip = 1 if config.max_batch_size > 0 else 0
    _complete_tensors(config.input, om.inputs, skip)
    _complete_tensors(config.output, om.outputs, skip)


def _complete_tensors(declared: Any, found: tuple[OmTensor, ...], skip: int) -> None:
    if not declared:
        for tensor in found:
            declared.add(name=tensor.name)
    by_name = {tensor.name: tensor for tensor in found}
    for tensor in declared:
        om_tensor = by_name.get(tensor.name)
        if om_tensor is None or om_tensor.datatype is None:
            continue  # reported by _check, naming the .om's tensors
        if tensor.data_type == mc.TYPE_INVALID:
            tensor.data_type = om_tensor.datatype.config
        if not tensor.dims:
            dims = om_tensor.dims[skip:]
            if dims:
                tensor.dims.extend(dims)
            else:
                tensor.dims.append(1)
                tensor.reshape.SetInParent()


def _check(config: mc.ModelConfig, om: OmDescription, model_file: str) -> None:
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
    for kind, declared, found in (("input", config.input, om.inputs), ("output", config.output, om.outputs)):
        by_name = {tensor.name: tensor for tensor in found}
        for tensor in declared:
            om_tensor = by_name.get(tensor.name)
            if om_tensor is None:
                raise ModelLoadError(
                    f"model '{name}': config {kind} '{tensor.name}' is not in '{model_file}', whose {kind}s are "
                    f"{sorted(by_name)}"
                )
            _check_tensor(name, kind, tensor, om_tensor, skip=skip, model_file=model_file)
    missing = sorted({t.name for t in om.inputs} - {t.name for t in config.input})
    if missing:
        raise ModelLoadError(f"model '{name}': inputs {missing} of '{model_file}' are missing from the config")


def _check_tensor(model: str, kind: str, tensor: Any, om_tensor: OmTensor, *, skip: int, model_file: str) -> None:
    assert om_tensor.datatype is not None
    if tensor.data_type != om_tensor.datatype.config:
        raise ModelLoadError(
            f"model '{model}': config {kind} '{tensor.name}' has data type {mc.DataType.Name(tensor.data_type)}, "
            f"but '{model_file}' declares {om_tensor.datatype.config_name}"
        )
    om_dims = list(om_tensor.dims[skip:])
    config_dims = list(tensor.reshape.shape) if tensor.HasField("reshape") else list(tensor.dims)
    if config_dims != om_dims:
        batch = " after the batch dim" if skip else ""
        raise ModelLoadError(
            f"model '{model}': config {kind} '{tensor.name}' has dims {list(tensor.dims)}, but '{model_file}' "
            f"declares {list(om_tensor.dims)} ({om_dims}{batch})"
        )
