"""What a loaded `.om` declares: its tensors, their ACL types and dims, and its batch gears."""

from __future__ import annotations

import math
from dataclasses import dataclass

from geserve.backends.acl.runtime import DYNAMIC_TENSOR_NAME, Acl
from geserve.codecs import dtypes
from geserve.errors import ModelLoadError


@dataclass(frozen=True, slots=True)
class OmTensor:
    """One model input or output; `dims` has -1 for the batch of a dynamic-batch model."""

    name: str
    index: int
    acl_type: int
    datatype: dtypes.DataType | None  # None: a type Triton cannot serve
    dims: tuple[int, ...]
    size: int  # bytes at the largest gear

    @property
    def row_bytes(self) -> int:
        """Bytes of one row along the first dim (all of it for a scalar)."""
        itemsize = self.datatype.itemsize if self.datatype is not None and self.datatype.itemsize else 1
        return math.prod(self.dims[1:]) * itemsize if self.dims else itemsize


@dataclass(frozen=True, slots=True)
class OmDescription:
    inputs: tuple[OmTensor, ...]
    outputs: tuple[OmTensor, ...]
    gears: tuple[int, ...]  # --dynamic_batch_size values, ascending; () for a static model
    dynamic_input: int | None  # index of the runtime-filled ascend_mbatch_shape_data input
    dynamic_input_size: int
    input_count: int  # all inputs, the dynamic one included

    @property
    def static_batch(self) -> int | None:
        """N for a static model whose inputs and outputs all start with the same fixed dim N."""
        if self.gears:
            return None
        firsts = {t.dims[0] if t.dims else None for t in (*self.inputs, *self.outputs)}
        first = firsts.pop() if len(firsts) == 1 else None
        return first if first is not None and first > 0 else None

    @property
    def rows(self) -> int:
        """Rows the device buffers hold: the largest gear, the static batch, or 0 (no batch dim)."""
        return max(self.gears) if self.gears else (self.static_batch or 0)

    def gear_for(self, rows: int) -> int:
        """The smallest gear that holds `rows` (the static batch for a static model)."""
        for gear in self.gears:
            if gear >= rows:
                return gear
        return self.rows


def describe(acl: Acl, desc: int, model_name: str) -> OmDescription:
    """Read inputs, outputs and gears from a model description filled by acl.mdl.get_desc."""
    mdl = acl.module.mdl
    batch_info = acl.out("acl.mdl.get_dynamic_batch", mdl.get_dynamic_batch(desc))
    gears = tuple(sorted(int(gear) for gear in batch_info.get("batch", [])[: int(batch_info.get("batchCount", 0))]))
    dynamic_input: int | None = None
    dynamic_input_size = 0
    inputs = []
    input_count = int(mdl.get_num_inputs(desc))
    for index in range(input_count):
        name = str(mdl.get_input_name_by_index(desc, index))
        if name == DYNAMIC_TENSOR_NAME:
            dynamic_input = index
            dynamic_input_size = int(mdl.get_input_size_by_index(desc, index))
            continue
        dims = acl.out("acl.mdl.get_input_dims", mdl.get_input_dims(desc, index))
        acl_type = int(mdl.get_input_data_type(desc, index))
        size = int(mdl.get_input_size_by_index(desc, index))
        inputs.append(_tensor(model_name, name, index, acl_type=acl_type, dims_info=dims, size=size, gears=gears))
    outputs = []
    for index in range(int(mdl.get_num_outputs(desc))):
        name = str(mdl.get_output_name_by_index(desc, index))
        dims = acl.out("acl.mdl.get_output_dims", mdl.get_output_dims(desc, index))
        acl_type = int(mdl.get_output_data_type(desc, index))
        size = int(mdl.get_output_size_by_index(desc, index))
        outputs.append(_tensor(model_name, name, index, acl_type=acl_type, dims_info=dims, size=size, gears=gears))
    if gears and dynamic_input is None:
        raise ModelLoadError(
            f"model '{model_name}': the model has batch gears {list(gears)} but no '{DYNAMIC_TENSOR_NAME}' input"
        )
    return OmDescription(tuple(inputs), tuple(outputs), gears, dynamic_input, dynamic_input_size, input_count)


def _tensor(
    model: str, name: str, index: int, *, acl_type: int, dims_info: dict[str, object], size: int, gears: tuple[int, ...]
) -> OmTensor:
    raw = dims_info.get("dims", [])
    count = dims_info.get("dimCount")
    dims = tuple(int(d) for d in (raw if isinstance(raw, list | tuple) else []))
    if isinstance(count, int):
        dims = dims[:count]
    if any(d < 0 for d in dims[1:]) or (dims and dims[0] < 0 and not gears):
        raise ModelLoadError(
            f"model '{model}': tensor '{name}' has dims {list(dims)}; only dynamic batch sizes (ATC "
            "--dynamic_batch_size) are supported, not dynamic image sizes, dynamic dims or shape ranges"
        )
    if gears and dims and dims[0] >= 0:
        raise ModelLoadError(
            f"model '{model}': tensor '{name}' has a fixed first dim {dims[0]} in a model with batch gears"
        )
    datatype = dtypes.from_acl(acl_type)
    if datatype is not None and datatype.itemsize is not None:
        # Trust the dims over the reported size (which may include format padding), and never
        # allocate less than the dims need.
        needed = math.prod(max(gears) if d < 0 else d for d in dims) * datatype.itemsize
        size = max(size, needed)
    return OmTensor(name, index, acl_type, datatype, dims, size)
