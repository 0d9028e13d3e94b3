"""A loaded model's description, read through pyACL's `acl.mdl.get_*` calls."""

from __future__ import annotations

from typing import Any

from geserve.backends.acl.description import (
    DYNAMIC_TENSOR_NAME,
    GEAR_BATCH,
    GEAR_DIMS,
    GEAR_IMAGE_SIZE,
    OmDescription,
    OmTensor,
    format_name,
    resolve_input_dims,
    tensor_size,
)
from geserve.backends.acl.runtime import Acl


def describe(acl: Acl, desc: int, soc_version: str | None = None) -> OmDescription:
    """Inputs, outputs and gears from a description filled by acl.mdl.get_desc."""
    mdl = acl.module.mdl
    batch_info = acl.out("acl.mdl.get_dynamic_batch", mdl.get_dynamic_batch(desc))
    gears = tuple(sorted(int(g) for g in batch_info.get("batch", [])[: int(batch_info.get("batchCount", 0))]))
    largest = max(gears, default=0)
    inputs: list[OmTensor] = []
    dynamic_input: OmTensor | None = None
    for index in range(int(mdl.get_num_inputs(desc))):
        tensor = _tensor(acl, desc, index, largest, inputs=True)
        if tensor.name == DYNAMIC_TENSOR_NAME:
            dynamic_input = tensor
        else:
            inputs.append(tensor)
    outputs = [_tensor(acl, desc, index, largest, inputs=False) for index in range(int(mdl.get_num_outputs(desc)))]
    kind, shapes = (GEAR_BATCH, tuple((g,) for g in gears)) if gears else _other_gears(mdl, desc, inputs)
    order = tuple(t.name for t in inputs if any(d < 0 for d in t.dims)) if kind else ()
    return OmDescription(
        tuple(inputs),
        tuple(outputs),
        gears,
        dynamic_input,
        soc_version=soc_version,
        gear_kind=kind,
        gear_shapes=shapes,
        data_name_order=order,
    )


def _tensor(acl: Acl, desc: int, index: int, largest: int, *, inputs: bool) -> OmTensor:
    mdl = acl.module.mdl
    side = "input" if inputs else "output"
    name = str(getattr(mdl, f"get_{side}_name_by_index")(desc, index))
    dims_info = acl.out(f"acl.mdl.get_{side}_dims", getattr(mdl, f"get_{side}_dims")(desc, index))
    raw = dims_info.get("dims", [])
    dims = tuple(int(d) for d in (raw if isinstance(raw, list | tuple) else []))
    count = dims_info.get("dimCount")
    if isinstance(count, int):
        dims = dims[:count]
    acl_type = int(getattr(mdl, f"get_{side}_data_type")(desc, index))
    size = int(getattr(mdl, f"get_{side}_size_by_index")(desc, index))
    reader = getattr(mdl, f"get_{side}_format", None)
    fmt = format_name(int(reader(desc, index))) if reader is not None else "ND"
    v2_reader = getattr(mdl, "get_input_dims_v2", None) if inputs else None  # older pyACL builds lack it
    if v2_reader is not None:
        tensor = resolve_input_dims(
            OmTensor(name, index, acl_type, dims, size, fmt, dims_v2=_dims_v2(acl, v2_reader(desc, index))),
            largest,
        )
        if tensor.dims_v1:  # static AIPP: the size is the buffer's, and check_servable holds the dims to it
            return tensor
    # Trust the dims over the reported size (which may include format padding), and never allocate
    # less than the dims need.
    return OmTensor(name, index, acl_type, dims, max(size, tensor_size(acl_type, dims, largest)), fmt)


def _dims_v2(acl: Acl, result: tuple[Any, ...]) -> tuple[int, ...]:
    dims_info = acl.out("acl.mdl.get_input_dims_v2", result)
    raw = dims_info.get("dims", [])
    dims = tuple(int(d) for d in (raw if isinstance(raw, list | tuple) else []))
    count = dims_info.get("dimCount")
    return dims[:count] if isinstance(count, int) else dims


def _other_gears(mdl: Any, desc: int, inputs: list[OmTensor]) -> tuple[str, tuple[tuple[int, ...], ...]]:
    """Image-size or dims gears, for a model whose inputs have unknown dims past the batch."""
    if not any(d < 0 for t in inputs for d in t.dims):
        return "", ()
    hw_reader = getattr(mdl, "get_dynamic_hw", None)
    if hw_reader is not None:
        info, ret = hw_reader(desc, -1)
        if ret == 0 and isinstance(info, dict) and int(info.get("hwCount", 0)) > 0:
            return GEAR_IMAGE_SIZE, tuple(tuple(int(v) for v in hw) for hw in info.get("hw", []))
    count_reader = getattr(mdl, "get_input_dynamic_gear_count", None)
    dims_reader = getattr(mdl, "get_input_dynamic_dims", None)
    if count_reader is not None and dims_reader is not None:
        count, ret = count_reader(desc, -1)
        if ret == 0 and count > 0:
            gears, ret = dims_reader(desc, -1, count)
            if ret == 0:
                return GEAR_DIMS, tuple(tuple(int(v) for v in gear.get("dims", [])) for gear in gears)
    return "", ()
