"""The MODEL_DEF partition of an `.om` file (GE's `ge.proto.ModelDef`): inputs, outputs and gears from the graph."""

# Files from before CANN 7 carry no MODEL_INOUT_INFO, so their description comes from here, by the
# rules GE itself uses (model_introduction.cc, davinci_model.cc, multi_batch_clone_pass.cc).

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from google.protobuf.message import DecodeError

from geserve._generated import om_model_def_pb2 as om
from geserve.backends.acl.description import (
    GEAR_BATCH,
    GEAR_DIMS,
    GEAR_IMAGE_SIZE,
    OmTensor,
    tensor_size,
)
from geserve.backends.acl.om_records import OmContents, OmFormatError

_INPUT_OPS = ("Data", "AippData", "AnnData")
_GEAR_OPS = ("Case", "StreamSwitchN")  # StreamSwitchN carried the gears before GE moved them to Case
_GEAR_KINDS = {1: GEAR_BATCH, 2: GEAR_IMAGE_SIZE, 3: GEAR_DIMS}  # the Case op's mbatch_dynamic_type
# ge.proto.DataType (ge_ir.proto) -> aclDataType: the graph numbers types differently from the runtime.
_ACL_TYPES = {
    1: 0, 2: 1, 3: 2, 4: 4, 5: 6, 6: 7, 7: 3, 8: 9, 9: 8, 10: 10, 11: 12, 12: 11, 13: 13, 16: 16, 17: 17,
    27: 27, 28: 29,
}  # fmt: skip
_UNKNOWN_TYPE = -1


def parse_model_def(data: bytes) -> OmContents:
    model = om.OmModelDef()
    try:
        model.ParseFromString(data)
    except DecodeError as error:
        raise OmFormatError(f"MODEL_DEF is not a GE ModelDef protobuf ({error})") from None
    if not model.graph:
        raise OmFormatError(
            "MODEL_DEF holds no graph: this is not an Ascend ATC model (HiAI/Kirin .om files, for example)"
        )
    graph = model.graph[0]  # the root graph; the others are subgraphs such as gear branches
    contents = OmContents(soc_version=_string(model.attr, "soc_version") or None)
    found = [op for op in graph.op if op.type in _INPUT_OPS]
    # Inputs are ordered by their `index` attr; files without it list them in graph order.
    data_ops = [
        op for _, op in sorted(enumerate(found), key=lambda item: (_int(item[1].attr, "index", item[0]), item[0]))
    ]
    gear_op = next((op for op in graph.op if op.type in _GEAR_OPS and "_batch_num" in op.attr), None)
    if gear_op is not None:
        _read_gears(gear_op, contents)
    largest = max((shape[0] for shape in contents.gear_shapes), default=0) if contents.gear_kind == GEAR_BATCH else 0
    for index, op in enumerate(data_ops):
        if not op.input_desc and not op.output_desc:
            raise OmFormatError(f"input op '{op.name}' has no tensor description")
        desc = op.input_desc[0] if op.input_desc else op.output_desc[0]
        dims = _ints(op.attr, "_dynamic_aipp_input_dims") or _ints(op.attr, "_mbatch_origin_input_dims")
        tensor = _tensor(op.name, index, desc, dims or tuple(desc.shape.dim), largest)
        aipp_dims = _ints(op.attr, "input_dims")  # static AIPP: the buffer's dims (aclmdlGetInputDimsV2)
        if aipp_dims:
            # The Data's size is the AIPP buffer's, which its image dims do not give (GE
            # util_insert_aipp_op.cc UpdatePrevNodeByAipp sets it from the Aipp op's input).
            size = desc.size if desc.size > 0 else tensor_size(tensor.acl_type, aipp_dims, largest)
            tensor = replace(tensor, size=size, dims_v2=aipp_dims)
        contents.inputs.append(tensor)
    outputs = [op for op in graph.op if op.type == "NetOutput"]
    if len(outputs) != 1:
        raise OmFormatError(f"the root graph has {len(outputs)} NetOutput ops, not one")
    contents.outputs = _outputs(model, outputs[0], largest)
    # What aclmdlGetCurOutputDims answers from once a gear is set (GE's GetModelAttr reads it here).
    contents.dynamic_output_dims = [
        s.decode("utf-8", "replace") for s in _list(outputs[0].attr, "_dynamic_output_dims").s
    ]
    return contents


def _read_gears(op: om.OmOp, contents: OmContents) -> None:
    count = _int(op.attr, "_batch_num", 0)
    if not 0 < count <= 4096:
        raise OmFormatError(f"gear op '{op.name}' says it has {count} gears")
    shapes = [_ints(op.attr, f"_pred_value_{i}") for i in range(count)]
    kind = _GEAR_KINDS.get(_int(op.attr, "mbatch_dynamic_type", 0))
    if kind is None:  # older files: one value per gear is a batch size
        kind = GEAR_BATCH if all(len(shape) == 1 for shape in shapes) else GEAR_DIMS
    if kind == GEAR_BATCH and any(len(shape) != 1 or shape[0] <= 0 for shape in shapes):
        raise OmFormatError(f"gear op '{op.name}' has batch gears {[list(s) for s in shapes]}, not one size each")
    contents.gear_kind = kind
    contents.gear_shapes = shapes
    contents.data_name_order = [s.decode("utf-8", "replace") for s in _list(op.attr, "user_designate_shape_order").s]


def _outputs(model: om.OmModelDef, net_output: om.OmOp, largest: int) -> list[OmTensor]:
    """Outputs are the NetOutput's inputs, named as GE names them (ConstructOutputInfo)."""
    out_nodes = [s.decode("utf-8", "replace") for s in _list(model.attr, "attr_model_out_nodes_name").s]
    sources = list(net_output.src_name)
    indexes = list(net_output.src_index)
    tensors = []
    for index, desc in enumerate(net_output.input_desc):
        source_index = indexes[index] if index < len(indexes) else 0
        if len(out_nodes) == len(net_output.input_desc):
            name = out_nodes[index] if ":" in out_nodes[index] else f"{out_nodes[index]}:{source_index}"
        else:
            source = sources[index] if index < len(sources) else ""
            name = f"output_{index}_{source}_{source_index}"
        tensors.append(_tensor(name, index, desc, tuple(desc.shape.dim), largest))
    return tensors


def _tensor(name: str, index: int, desc: om.OmTensorDesc, dims: tuple[int, ...], largest: int) -> OmTensor:
    acl_type = _ACL_TYPES.get(desc.dtype, _UNKNOWN_TYPE)
    layout = desc.layout or "ND"
    size = tensor_size(acl_type, dims, largest) or max(desc.size, 0)
    return OmTensor(name, index, acl_type, dims, size, layout)


def _list(attrs: Mapping[str, om.OmAttr], key: str) -> om.OmAttr.Values:
    attr = attrs.get(key)
    return attr.list if attr is not None and attr.WhichOneof("value") == "list" else om.OmAttr.Values()


def _ints(attrs: Mapping[str, om.OmAttr], key: str) -> tuple[int, ...]:
    return tuple(int(v) for v in _list(attrs, key).i)


def _int(attrs: Mapping[str, om.OmAttr], key: str, default: int) -> int:
    attr = attrs.get(key)
    return int(attr.i) if attr is not None and attr.WhichOneof("value") == "i" else default


def _string(attrs: Mapping[str, om.OmAttr], key: str) -> str:
    attr = attrs.get(key)
    return attr.s.decode("utf-8", "replace") if attr is not None and attr.WhichOneof("value") == "s" else ""
