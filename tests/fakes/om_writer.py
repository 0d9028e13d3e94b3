"""Writes real-format `.om` files (IMOD header, partition table, MODEL_INOUT_INFO, MODEL_DEF) for tests.

It takes a description with the keys of tests/data/om-samples/expected.json and lays it out as ATC
does (om-format.md): Data ops with `index` and `_mbatch_origin_input_dims` (and, for an input with
`dims_v2`, static AIPP's `input_dims` and the buffer's size), the
`ascend_mbatch_shape_data` input and a `Case` op carrying the gears, a NetOutput whose inputs are
the outputs and which carries `_dynamic_output_dims` for gear models, and `attr_model_out_nodes_name`
holding their ATC names. Whatever it writes, the reader must describe exactly as asked (an AIPP input
by its `dims_v2`, the dims its size has); tests check that for every sample too. It writes no weights
or kernels: these files describe models, the simulator runs them. In their place the TASK_INFO
partition holds the writer's own record of what it was asked to write (`SIM_RECORD_MAGIC`, then the
description as JSON), which the simulator describes the model from, so that pyACL's answers in tests
never come from geserve's reader.
"""

from __future__ import annotations

import io
import json
import re
import struct
import zipfile
from pathlib import Path
from typing import Any

from geserve._generated import om_model_def_pb2 as om
from geserve.backends.acl.description import FORMAT_VALUES, TYPE_NAMES
from geserve.codecs import dtypes

VERSION_1, VERSION_2 = 0x10000000, 0x20000000
_ACL_TYPES = {name: value for value, name in TYPE_NAMES.items()}
# aclDataType -> ge.proto.DataType, the numbering inside MODEL_DEF
_GRAPH_TYPES = {0: 1, 1: 2, 2: 3, 4: 4, 6: 5, 7: 6, 3: 7, 9: 8, 8: 9, 10: 10, 12: 11, 11: 12, 13: 13, 27: 27}
_GEAR_KEYS = {"dynamic_batch": (1, 2), "dynamic_image_size": (2, 3), "dynamic_dims": (3, 4)}  # type, TLV
_GRAPH_API_NAME = re.compile(r"^output_(\d+)_(.+)_(\d+)$")
# The simulator's record in TASK_INFO: this magic, a u32 length, then JSON {"description", "dynamic_output_dims"}.
SIM_RECORD_MAGIC = b"GESERVE-OM-WRITER-RECORD\0"
_DEFAULT = object()


def om_bytes(
    description: dict[str, Any],
    *,
    header_version: int = VERSION_2,
    wide_table: bool | None = None,
    inout_info: bool = True,
    platform_version: str = "1.11.z.0",
    sub_models: tuple[dict[str, Any], ...] = (),
    dynamic_output_dims: Any = _DEFAULT,
) -> bytes:
    """A whole `.om` file. `wide_table` (64-bit partition entries) defaults to on for v2 headers;
    `inout_info` adds the MODEL_INOUT_INFO partition newer ATC versions write; `sub_models` follow
    the root model as a dynamic-shape root model's do (one table and its partitions each).
    `dynamic_output_dims` replaces the NetOutput's `_dynamic_output_dims` strings (None: leave the
    attribute out, as a file GE did not build would); by default they are GE's for batch gears."""
    wide = header_version == VERSION_2 if wide_table is None else wide_table
    if wide and header_version != VERSION_2:
        raise ValueError("64-bit partition tables need a v2 header")
    if sub_models and header_version != VERSION_2:
        raise ValueError("sub-models need a v2 header (model_num)")
    output_dims = default_dynamic_output_dims(description) if dynamic_output_dims is _DEFAULT else dynamic_output_dims
    body = b"".join(
        _model_body(model, wide, inout_info, output_dims if index == 0 else default_dynamic_output_dims(model))
        for index, model in enumerate((description, *sub_models))
    )
    header = bytearray(256)
    struct.pack_into("<III", header, 0, 0x444F4D49, 256, header_version)
    struct.pack_into("<I", header, 76, 0 if wide else len(body))
    name = str(description.get("name", "")).encode()[:31]
    header[84 : 84 + len(name)] = name
    version = platform_version.encode()[:19]
    if header_version == VERSION_2:
        struct.pack_into("<I", header, 156, 1 + len(sub_models))  # model_num
        header[160 : 160 + len(version)] = version
        if wide:
            struct.pack_into("<Q", header, 184, len(body))
    else:
        header[156 : 156 + len(version)] = version
    return bytes(header) + body


def _model_body(description: dict[str, Any], wide: bool, inout_info: bool, output_dims: list[str] | None) -> bytes:
    """One model's partition table and its partitions, back to back."""
    definition = model_def(description, output_dims).SerializeToString()
    partitions = [(0, definition), (1, b""), (3, b""), (2, sim_record(description, output_dims))]
    if inout_info:
        partitions.insert(0, (8, inout_records(description, output_dims)))
    table = io.BytesIO()
    table.write(struct.pack("<II", len(partitions), 0) if wide else struct.pack("<I", len(partitions)))
    offset = 0
    for kind, data in partitions:
        if wide:
            table.write(struct.pack("<IIQQ", kind, 0, offset, len(data)))
        else:
            table.write(struct.pack("<III", kind, offset, len(data)))
        offset += len(data)
    return table.getvalue() + b"".join(data for _, data in partitions)


def write_om(path: Path, description: dict[str, Any], **options: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(om_bytes(description, **options))
    return path


def om2_bytes(description: dict[str, Any]) -> bytes:
    """An OM2 archive: model_meta.json with the keys GE's om2_model_executor.cc reads."""
    dynamic = description.get("dynamic") or {}
    kind = next((key for key in _GEAR_KEYS if key in dynamic), None)

    def entry(tensor: dict[str, Any]) -> dict[str, Any]:
        return {
            "name": tensor["name"],
            "shape": _max_gear_dims(tensor["dims"], dynamic),
            "origin_input_dims": tensor["dims"],
            "shape_v2": tensor.get("dims_v2", _max_gear_dims(tensor["dims"], dynamic)),
            "data_type": _ACL_TYPES[tensor["dtype"]],
            "format": FORMAT_VALUES[tensor["format"]],
            "size": 0,
        }

    meta: dict[str, Any] = {
        "name": description.get("name", ""),
        "inputs": [entry(tensor) for tensor in description["inputs"]],
        "outputs": [entry(tensor) for tensor in description["outputs"]],
    }
    if kind is not None:
        values = dynamic[kind]
        meta["dynamic_type"] = _GEAR_KEYS[kind][0]
        meta["dynamic_batch_info"] = [[v] for v in values] if kind == "dynamic_batch" else values
        meta["user_designate_shape_order"] = dynamic.get("data_name_order", [])
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("model/model_meta.json", json.dumps(meta))
    return buffer.getvalue()


def sim_record(description: dict[str, Any], output_dims: list[str] | None) -> bytes:
    """What the simulator reads back: the description as asked and the `_dynamic_output_dims` written."""
    record = json.dumps({"description": description, "dynamic_output_dims": output_dims}).encode()
    return SIM_RECORD_MAGIC + struct.pack("<I", len(record)) + record


def default_dynamic_output_dims(description: dict[str, Any]) -> list[str] | None:
    """The NetOutput's `_dynamic_output_dims` as ATC writes it for batch gears: `"<gear index>,<output
    index>,<dims at that gear>"` for each output the gear branches produce, gear index in the order of
    the Case op's `_pred_value_<i>`, then `"-1,<output index>,<dims>"` for outputs that do not come from
    the branches (G1 compiler/graph/preprocess/multi_batch_copy_graph.cc `GetDynamicShapeByGraph`,
    `GetDirectOutputShape`, `kStaticOutput = -1`; dims joined by commas as `GeShape::ToString` does).
    Here an output comes from the branches when its first dim is the largest gear."""
    gears = (description.get("dynamic") or {}).get("dynamic_batch")
    if not gears:
        return None
    largest = max(gears)
    batched = [i for i, t in enumerate(description["outputs"]) if t["dims"] and t["dims"][0] == largest]
    entries = [
        ",".join(str(v) for v in (gear_index, i, gear, *description["outputs"][i]["dims"][1:]))
        for i in batched
        for gear_index, gear in enumerate(gears)
    ]
    entries += [
        ",".join(str(v) for v in (-1, i, *t["dims"])) for i, t in enumerate(description["outputs"]) if i not in batched
    ]
    return entries


# -- MODEL_DEF -------------------------------------------------------------------------------


def model_def(description: dict[str, Any], output_dims: list[str] | None = None) -> om.OmModelDef:
    model = om.OmModelDef(name=str(description.get("name", "")), version=1)
    if description.get("soc_version"):
        model.attr["soc_version"].s = str(description["soc_version"]).encode()
    dynamic = description.get("dynamic") or {}
    graph = model.graph.add(name=f"{model.name}_0")
    for index, tensor in enumerate(description["inputs"]):
        op = graph.op.add(name=tensor["name"], type="Data")
        op.attr["index"].i = index
        desc = _desc(tensor, _max_gear_dims(tensor["dims"], dynamic))
        op.input_desc.append(desc)
        op.output_desc.append(desc)
        if any(d < 0 for d in tensor["dims"]):
            op.attr["_mbatch_origin_input_dims"].list.i.extend(tensor["dims"])
        if "dims_v2" in tensor:  # static AIPP: the buffer's dims, and the Data's size is the buffer's
            op.attr["input_dims"].list.i.extend(tensor["dims_v2"])
            desc.size = _nbytes(tensor, tensor["dims_v2"], dynamic)
            op.input_desc[0].size = op.output_desc[0].size = desc.size
    kind = next((key for key in _GEAR_KEYS if key in dynamic), None)
    if kind is not None:
        case = graph.op.add(name="ascend_mbatch_shape_case", type="Case")
        values = dynamic[kind]
        gears = [[v] for v in values] if kind == "dynamic_batch" else values
        case.attr["_batch_num"].i = len(gears)
        for i, gear in enumerate(gears):
            case.attr[f"_pred_value_{i}"].list.i.extend(gear)
        case.attr["mbatch_dynamic_type"].i = _GEAR_KEYS[kind][0]
        case.attr["mbatch-inserted-node"].b = True
        case.attr["user_designate_shape_order"].list.s.extend(n.encode() for n in dynamic.get("data_name_order", []))
    net_output = graph.op.add(name="Node_Output", type="NetOutput")
    if output_dims is not None:
        net_output.attr["_dynamic_output_dims"].list.s.extend(entry.encode() for entry in output_dims)
    out_nodes = []
    for index, tensor in enumerate(description["outputs"]):
        net_output.input_desc.append(_desc(tensor, tensor["dims"]))
        name = tensor["name"]
        graph_api = _GRAPH_API_NAME.match(name)
        if graph_api is not None and int(graph_api[1]) == index:
            net_output.src_name.append(graph_api[2])
            net_output.src_index.append(int(graph_api[3]))
        elif ":" in name:
            node, _, rest = name.partition(":")
            net_output.src_name.append(node)
            net_output.src_index.append(int(rest.split(":")[0]) if rest.split(":")[0].isdigit() else 0)
            out_nodes.append(name)
        else:
            raise ValueError(f"ATC never names an output '{name}' (it appends ':<index>')")
    if out_nodes:
        if len(out_nodes) != len(description["outputs"]):
            raise ValueError("mixing graph-API and ATC output names is not something GE writes")
        model.attr["attr_model_out_nodes_name"].list.s.extend(n.encode() for n in out_nodes)
    return model


def _desc(tensor: dict[str, Any], dims: list[int]) -> om.OmTensorDesc:
    desc = om.OmTensorDesc(dtype=_GRAPH_TYPES[_ACL_TYPES[tensor["dtype"]]], layout=tensor["format"])
    desc.shape.dim.extend(dims)
    return desc


def _max_gear_dims(dims: list[int], dynamic: dict[str, Any]) -> list[int]:
    """Data ops hold the largest gear's shape; the -1s live in _mbatch_origin_input_dims."""
    largest = max(dynamic.get("dynamic_batch", [1]))
    return [largest if d < 0 else d for d in dims]


# -- MODEL_INOUT_INFO ------------------------------------------------------------------------


def inout_records(description: dict[str, Any], output_dims: list[str] | None = None) -> bytes:
    dynamic = description.get("dynamic") or {}
    records = [(0, _tensors(description["inputs"], dynamic)), (1, _tensors(description["outputs"], dynamic))]
    kind = next((key for key in _GEAR_KEYS if key in dynamic), None)
    if kind == "dynamic_batch":
        values = dynamic[kind]
        records.append((2, struct.pack(f"<I{len(values)}q", len(values), *values)))
    elif kind is not None:
        gears = dynamic[kind]
        parts = struct.pack(f"<I{len(gears)}I", len(gears), *(len(g) for g in gears))
        records.append((_GEAR_KEYS[kind][1], parts + b"".join(struct.pack(f"<{len(g)}q", *g) for g in gears)))
    # DYNAMIC_OUTPUT_SHAPE (5) holds the NetOutput's `_dynamic_output_dims` (G1 model_introduction.cc
    # `ConstructDynamicOutShape`); like every record, it is left out when empty.
    for kind, strings in ((5, output_dims or []), (6, dynamic.get("data_name_order", []))):
        encoded = [n.encode() for n in strings]
        if encoded:
            lengths = struct.pack(f"<I{len(encoded)}I", len(encoded), *(len(n) for n in encoded))
            records.append((kind, lengths + b"".join(encoded)))
    return b"".join(struct.pack("<iI", kind, len(value)) + value for kind, value in records)


def _tensors(tensors: list[dict[str, Any]], dynamic: dict[str, Any]) -> bytes:
    out = [struct.pack("<I", len(tensors))]
    for tensor in tensors:
        name = tensor["name"].encode()
        dims = tensor["dims"]
        acl_type = _ACL_TYPES[tensor["dtype"]]
        dims_v2 = tensor.get("dims_v2", dims)  # static AIPP inputs differ (GE CreateInputDimsInfo)
        size = _nbytes(tensor, dims_v2, dynamic)
        packed, packed_v2 = struct.pack(f"<{len(dims)}q", *dims), struct.pack(f"<{len(dims_v2)}q", *dims_v2)
        header = struct.pack(
            "<QiiIIII", size, FORMAT_VALUES[tensor["format"]], acl_type, len(name), len(packed), len(packed_v2), 0
        )
        out.append(header + name + packed + packed_v2)
    return b"".join(out)


def _nbytes(tensor: dict[str, Any], dims: list[int], dynamic: dict[str, Any]) -> int:
    datatype = dtypes.from_acl(_ACL_TYPES[tensor["dtype"]])
    size = (datatype.itemsize or 0) if datatype is not None else 0
    for d in _max_gear_dims(dims, dynamic):
        size *= d
    return size
