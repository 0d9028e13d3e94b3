"""What an `.om` model declares (tensors, ACL types, dims, formats, gears), one type for pyACL and the file reader."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from geserve.codecs import dtypes
from geserve.errors import ModelLoadError

# The name ATC gives the runtime-filled gear input (ACL_DYNAMIC_TENSOR_NAME in acl_mdl.h).
DYNAMIC_TENSOR_NAME = "ascend_mbatch_shape_data"
# The input ATC adds for dynamic AIPP (ACL_DYNAMIC_AIPP_NAME in acl_mdl.h; GE ge_aipp_op.cc kDynamicAippData).
DYNAMIC_AIPP_TENSOR_NAME = "ascend_dynamic_aipp_data"
GEAR_BATCH, GEAR_IMAGE_SIZE, GEAR_DIMS = "batch", "image_size", "dims"
_GEAR_OPTIONS = {
    GEAR_BATCH: "--dynamic_batch_size",
    GEAR_IMAGE_SIZE: "--dynamic_image_size",
    GEAR_DIMS: "--dynamic_dims",
}

# aclFormat (acl_base_rt.h); ge::Format uses the same numbering.
FORMAT_NAMES = {
    -1: "UNDEFINED", 0: "NCHW", 1: "NHWC", 2: "ND", 3: "NC1HWC0", 4: "FRACTAL_Z", 12: "NC1HWC0_C04",
    16: "HWCN", 27: "NDHWC", 29: "FRACTAL_NZ", 30: "NCDHW", 32: "NDC1HWC0", 33: "FRACTAL_Z_3D", 35: "NC", 47: "NCL",
}  # fmt: skip
FORMAT_VALUES = {name: value for value, name in FORMAT_NAMES.items()}
# aclDataType -> the numpy name a description shows (expected.json's "dtype").
TYPE_NAMES = {
    0: "float32", 1: "float16", 2: "int8", 3: "int32", 4: "uint8", 6: "int16", 7: "uint16", 8: "uint32",
    9: "int64", 10: "uint64", 11: "float64", 12: "bool", 13: "string", 16: "complex64", 17: "complex128",
    27: "bfloat16", 29: "int4",
}  # fmt: skip


def format_name(value: int) -> str:
    return FORMAT_NAMES.get(value, f"FORMAT_{value}")


def type_name(acl_type: int) -> str:
    return TYPE_NAMES.get(acl_type, f"acl_type_{acl_type}")


@dataclass(frozen=True, slots=True)
class OmTensor:
    """One model input or output. Inputs of a gear model have -1 for the batch; outputs report the
    largest gear's dims, as `aclmdlGetOutputDims` does."""

    name: str
    index: int
    acl_type: int
    dims: tuple[int, ...]
    size: int  # bytes at the largest gear
    format: str = "ND"
    # What aclmdlGetInputDims and aclmdlGetInputDimsV2 report, kept only where the two differ (static AIPP);
    # `dims` is then whichever of them multiplies out to `size` (see resolve_input_dims).
    dims_v1: tuple[int, ...] = ()
    dims_v2: tuple[int, ...] = ()

    @property
    def datatype(self) -> dtypes.DataType | None:
        """The Triton type, or None for a type Triton cannot serve."""
        return dtypes.from_acl(self.acl_type)

    @property
    def row_bytes(self) -> int:
        """Bytes of one row along the first dim (all of it for a scalar)."""
        datatype = self.datatype
        itemsize = datatype.itemsize if datatype is not None and datatype.itemsize else 1
        return math.prod(self.dims[1:]) * itemsize if self.dims else itemsize

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": type_name(self.acl_type), "dims": list(self.dims), "format": self.format}


@dataclass(frozen=True, slots=True)
class OmDescription:
    """A whole model: servable inputs and outputs, and the gears it was compiled with."""

    inputs: tuple[OmTensor, ...]  # without the runtime-filled gear input
    outputs: tuple[OmTensor, ...]
    gears: tuple[int, ...] = ()  # --dynamic_batch_size values, ascending; () otherwise
    dynamic_input: OmTensor | None = None  # ascend_mbatch_shape_data, at its own index
    name: str = ""
    soc_version: str | None = None
    header_version: int | None = None  # the file header's, when read from the file
    gear_kind: str = ""  # GEAR_BATCH, GEAR_IMAGE_SIZE, GEAR_DIMS, or "" for a static model
    gear_shapes: tuple[tuple[int, ...], ...] = ()  # every gear's values, for any kind
    data_name_order: tuple[str, ...] = ()  # the inputs the gears apply to, in order
    # The NetOutput's `_dynamic_output_dims`: "<gear index>,<output index>,<dims>" each, the gear index -1
    # for an output every gear shares (GE's multi_batch_copy_graph.cc); what aclmdlGetCurOutputDims
    # answers from once a gear is set. Not readable through pyACL, so only the file reader fills it;
    # None where the description cannot say (read through pyACL, or from an OM2 archive's metadata).
    dynamic_output_dims: tuple[str, ...] | None = None

    @property
    def input_count(self) -> int:
        """All inputs, the gear input included (what aclmdlGetNumInputs counts)."""
        return len(self.inputs) + (1 if self.dynamic_input is not None else 0)

    @property
    def static_batch(self) -> int | None:
        """N for a static model whose inputs and outputs all start with the same fixed dim N."""
        if self.gear_kind:
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

    def to_json(self) -> dict[str, Any]:
        """The keys of tests/data/om-samples/expected.json."""
        dynamic: dict[str, Any] | None = None
        if self.gear_kind:
            key = {GEAR_BATCH: "dynamic_batch", GEAR_IMAGE_SIZE: "dynamic_image_size", GEAR_DIMS: "dynamic_dims"}
            values: list[Any] = (
                list(self.gears) if self.gear_kind == GEAR_BATCH else [list(s) for s in self.gear_shapes]
            )
            dynamic = {key[self.gear_kind]: values, "data_name_order": list(self.data_name_order)}
        inputs = sorted((*self.inputs, *([self.dynamic_input] if self.dynamic_input else [])), key=lambda t: t.index)
        return {
            "name": self.name,
            "header_version": f"{self.header_version:#010x}" if self.header_version is not None else None,
            "soc_version": self.soc_version,
            "inputs": [tensor.to_json() for tensor in inputs],
            "outputs": [tensor.to_json() for tensor in self.outputs],
            "dynamic": dynamic,
        }


def tensor_size(acl_type: int, dims: tuple[int, ...], largest_batch: int) -> int:
    """Bytes at the largest gear (0 when a dim other than the batch is unknown or the type has no fixed size)."""
    datatype = dtypes.from_acl(acl_type)
    if datatype is None or not datatype.itemsize or any(d < 0 for d in dims[1:]):
        return 0
    resolved = [largest_batch if d < 0 else d for d in dims]
    return math.prod(resolved) * datatype.itemsize


def resolve_input_dims(tensor: OmTensor, largest_batch: int) -> OmTensor:
    """`tensor` as read (`dims` from aclmdlGetInputDims, `dims_v2` from aclmdlGetInputDimsV2, `dims_v1` not
    yet set), serving the dims that match its size.

    With static AIPP (ATC --insert_op_conf) the two differ: aclmdlGetInputDims gives the image's n,h,w,c and
    aclmdlGetInputDimsV2 the buffer's (YUV420SP_U8: n,h*1.5,w,1), and only the latter multiplies out to
    aclmdlGetInputSizeByIndex (CANN docs, aclmdlGetInputDimsV2). GE writes them from the Data op's shape and
    its `input_dims` attr (G1 model_introduction.cc CreateInputDimsInfo)."""
    if tensor.dims_v1:
        return tensor  # resolved already
    dims_v1, dims_v2 = tensor.dims, tensor.dims_v2
    if not dims_v2 or dims_v2 == dims_v1:
        return replace(tensor, dims_v2=()) if dims_v2 else tensor

    def fits(dims: tuple[int, ...]) -> bool:
        return tensor_size(tensor.acl_type, dims, largest_batch) == tensor.size

    # An unsized input (size 0) takes V2, the dims the documentation sizes buffers by.
    served = dims_v2 if not tensor.size or fits(dims_v2) else dims_v1 if fits(dims_v1) else dims_v2
    return replace(tensor, dims=served, dims_v1=dims_v1, dims_v2=dims_v2)


# The runtime takes an entry of 2 (gear, output) to 2 + ACL_MAX_DIM_CNT values (hicann/ge model_common.cpp).
_OUTPUT_DIMS_VALUES = range(2, 2 + 128 + 1)


def parse_output_dims(entry: str) -> tuple[int, ...]:
    """One `_dynamic_output_dims` string as the runtime reads it: digits make a number, '-' negates it, any
    other character ends it (hicann/ge api/acl/acl_model/model/model_common.cpp `GetModelOutputShapeInfoHelp`)."""
    values: list[int] = []
    value, sign = 0, 1
    for char in entry:
        if "0" <= char <= "9":
            value = value * 10 + ord(char) - ord("0")
        elif char == "-":
            sign = -1
        else:
            values.append(value * sign)
            value, sign = 0, 1
    values.append(value * sign)
    return tuple(values)


def cur_output_dims(om: OmDescription, gear_index: int, output_index: int) -> tuple[int, ...] | None:
    """What aclmdlGetCurOutputDims answers for an output once the gear at `gear_index` (in the file's gear
    order) is set: the dims of the first entry for that gear or -1 and that output, or None where the
    runtime fails (no such entry, or a malformed entry before it: model_common.cpp `GetCurOuputShapeInfo`).
    None also where the description does not know the model's `_dynamic_output_dims`."""
    for entry in om.dynamic_output_dims or ():
        values = parse_output_dims(entry)
        if len(values) not in _OUTPUT_DIMS_VALUES:
            return None
        if values[0] in (gear_index, -1) and values[1] == output_index:
            return values[2:]
    return None


def missing_output_dims(om: OmDescription) -> dict[int, tuple[int, ...]]:
    """Output index -> the batch sizes at which the file's `_dynamic_output_dims` give that output no dims
    (so aclmdlGetCurOutputDims fails for it once the batch size is set); empty where every output has dims
    at every gear, for a model without batch gears, and where the description cannot say."""
    if om.gear_kind != GEAR_BATCH or om.dynamic_output_dims is None:
        return {}
    missing: dict[int, tuple[int, ...]] = {}
    for tensor in om.outputs:
        # gear_shapes keeps the file's order, which the entries' gear indexes refer to (the Case op's
        # `_pred_value_<i>`, multi_batch_copy_graph.cc); `gears` is sorted.
        batches = tuple(
            shape[0]
            for gear_index, shape in enumerate(om.gear_shapes)
            if cur_output_dims(om, gear_index, tensor.index) is None
        )
        if batches:
            missing[tensor.index] = tuple(sorted(batches))
    return missing


def check_output_dims(om: OmDescription, model: str, model_file: str) -> None:
    """Refuse a batch-gear model whose `_dynamic_output_dims` leave an output without dims at some gear:
    aclmdlGetCurOutputDims fails (ACL_ERROR_FAILURE) for it at every batch run at that gear."""
    missing = missing_output_dims(om)
    if not missing:
        return
    names = {tensor.index: tensor.name for tensor in om.outputs}
    lacking = "; ".join(
        f"output {index} '{names[index]}' at batch size{'s' if len(batches) > 1 else ''} "
        f"{', '.join(str(b) for b in batches)}"
        for index, batches in missing.items()
    )
    entries = ", ".join(f'"{entry}"' for entry in om.dynamic_output_dims or ()) or "none"
    raise ModelLoadError(
        f"model '{model}': '{model_file}' has batch gears {list(om.gears)} but its NetOutput's "
        f'_dynamic_output_dims (entries: {entries}; each "<gear index>,<output index>,<dims>", gear index -1 '
        f"for every gear) give no dims for {lacking}: aclmdlGetCurOutputDims cannot give those outputs' shapes "
        "once a batch size is set, so every batch run at those sizes would fail; compile the model again with "
        "ATC, which writes the attribute for every output at every gear of --dynamic_batch_size"
    )


def check_servable(om: OmDescription, model: str, model_file: str) -> None:
    """Refuse what geserve cannot serve correctly, saying what it is."""
    where = f"model '{model}': '{model_file}'"
    if any(t.name == DYNAMIC_AIPP_TENSOR_NAME for t in om.inputs):
        raise ModelLoadError(
            f"{where}: dynamic AIPP is not supported: the model takes its preprocessing parameters (source "
            "image size, input format, colour conversion, crop, padding, per batch item) in its "
            f"'{DYNAMIC_AIPP_TENSOR_NAME}' input, which pyACL fills from an aclmdlAIPP object "
            "(acl.mdl.set_input_aipp) in a layout that only GE's internal headers define, so geserve can take it "
            "neither from a config nor from a client; compile the model with a static AIPP "
            "config (aipp_mode: static in ATC --insert_op_conf) or without AIPP"
        )
    if om.gear_kind and om.gear_kind != GEAR_BATCH:
        raise ModelLoadError(
            f"{where} was compiled with {om.gear_kind.replace('_', ' ')} gears (ATC {_GEAR_OPTIONS[om.gear_kind]}: "
            f"{[list(s) for s in om.gear_shapes]}), which geserve does not serve; only batch gears (ATC "
            "--dynamic_batch_size) are supported"
        )
    if om.gear_kind == GEAR_BATCH and om.dynamic_input is None:
        raise ModelLoadError(f"{where} has batch gears {list(om.gears)} but no '{DYNAMIC_TENSOR_NAME}' input")
    largest = max(om.gears, default=0)
    for kind, tensors in (("input", om.inputs), ("output", om.outputs)):
        for tensor in tensors:
            dims = list(tensor.dims)
            if any(d < 0 for d in dims[1:]) or (dims and dims[0] < 0 and not om.gears):
                raise ModelLoadError(
                    f"{where}: {kind} '{tensor.name}' has dims {dims}; only dynamic batch sizes (ATC "
                    "--dynamic_batch_size) are supported, not dynamic image sizes, dynamic dims or shape ranges"
                )
            # Inputs of a gear model carry -1 as the batch; outputs carry the largest gear (or -1 on old runtimes).
            if om.gears and (not dims or dims[0] not in (-1, largest) or (kind == "input" and dims[0] != -1)):
                raise ModelLoadError(
                    f"{where}: {kind} '{tensor.name}' has dims {dims} in a model with batch gears {list(om.gears)}; "
                    f"its first dim must be the batch ({'-1' if kind == 'input' else f'-1 or {largest}'})"
                )
    for tensor in om.inputs:
        if tensor.dims_v1 and tensor.size and tensor_size(tensor.acl_type, tensor.dims, largest) != tensor.size:
            raise ModelLoadError(
                f"{where}: input '{tensor.name}' is {tensor.size} bytes, which neither its dims {list(tensor.dims_v1)} "
                f"(aclmdlGetInputDims) nor its dims {list(tensor.dims_v2)} (aclmdlGetInputDimsV2, static AIPP) "
                f"make as {type_name(tensor.acl_type)}; geserve cannot tell clients what shape to send"
            )
