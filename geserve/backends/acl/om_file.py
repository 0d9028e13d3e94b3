"""Reading an ATC `.om` file without CANN or an NPU: header, partition tables, OM2 archives, refusals."""

# The container follows GE's om_file_helper.cc and model_parser_base.cc (see
# shared/reference/om-format.md): a 256-byte `IMOD` header (v1 or v2), then a partition table
# (12-byte entries, or 24-byte ones when the v2 header sets `model_length` or the model is a flow
# model), then the partitions back to back. The description comes from MODEL_INOUT_INFO when the
# file has it (what `aclmdlGetDesc` reads) and from the MODEL_DEF graph otherwise.

from __future__ import annotations

import io
import json
import math
import struct
import zipfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from geserve.backends.acl.description import (
    DYNAMIC_TENSOR_NAME,
    GEAR_BATCH,
    GEAR_DIMS,
    GEAR_IMAGE_SIZE,
    OmDescription,
    OmTensor,
    format_name,
    resolve_input_dims,
)
from geserve.backends.acl.om_graph import parse_model_def
from geserve.backends.acl.om_records import Cursor, OmContents, OmFormatError, parse_inout_info
from geserve.errors import ModelLoadError

MAGIC = b"IMOD"
HEADER_SIZE = 256
VERSION_1, VERSION_2 = 0x10000000, 0x20000000
MODEL_DEF, MODEL_INOUT_INFO = 0, 8
MODEL_TYPE_FLOW, MODEL_TYPE_BUNDLE = 3, 5
_ZIP_MAGIC = b"PK\x03\x04"
_SVP_MAGIC = b"PICO"
_MAX_META_BYTES = 16 << 20
_OM2_GEAR_KINDS = {1: GEAR_BATCH, 2: GEAR_IMAGE_SIZE, 3: GEAR_DIMS}


@dataclass(frozen=True, slots=True)
class OmHeader:
    """The fields of GE's ModelFileHeader that decide how the rest is read."""

    version: int
    length: int
    is_encrypt: int
    model_type: int
    name: str
    model_num: int
    model_length: int

    @property
    def wide_table(self) -> bool:
        """64-bit partition entries: late v2 files (model_length set) and flow models."""
        return self.version >= VERSION_2 and (self.model_length != 0 or self.model_type == MODEL_TYPE_FLOW)


def read_description(path: Path | str) -> OmDescription:
    """Describe the `.om` at `path`; a ModelLoadError naming the file when it cannot be read or served."""
    try:
        with open(path, "rb") as stream:
            size = stream.seek(0, io.SEEK_END)
            stream.seek(0)
            return _describe(stream, size)
    except OmFormatError as error:
        raise ModelLoadError(f"'{path}': {error}") from None
    except OSError as error:
        raise ModelLoadError(f"'{path}' cannot be read: {error.strerror or error}") from None


def describe_bytes(data: bytes) -> OmDescription:
    """Describe an `.om` held in memory; OmFormatError when it is not one."""
    return _describe(io.BytesIO(data), len(data))


def _describe(stream: BinaryIO, size: int) -> OmDescription:
    head = stream.read(HEADER_SIZE)
    if head.startswith(_ZIP_MAGIC):
        return _describe_om2(stream)
    if head.startswith(_SVP_MAGIC):
        raise OmFormatError("a HiSilicon SVP (Hi35xx) model ('PICO' magic), not Ascend ATC output")
    if not head.startswith(MAGIC):
        if _looks_encrypted(head + stream.read(4096)):
            raise OmFormatError("not an .om file: no IMOD magic (encrypted by the application that shipped it)")
        raise OmFormatError(f"not an .om file: no IMOD magic (it starts with {head[:8]!r})")
    header = _header(head, size)
    entries = _partition_table(stream, header, size)
    partitions = dict(entries)
    if MODEL_DEF not in partitions and MODEL_INOUT_INFO not in partitions:
        raise OmFormatError(f"no MODEL_DEF partition (partition types {[kind for kind, _ in entries]})")
    try:
        graph = parse_model_def(_read(stream, *partitions[MODEL_DEF])) if MODEL_DEF in partitions else None
    except OmFormatError as error:
        # HiAI (Kirin) files share the magic and the v1 header, and add their own fields at 177-204,
        # which ATC leaves zero (G1 base/common/helper/mobile/model_buffer_helper.cc).
        if header.version == VERSION_1 and any(head[177:205]):
            raise OmFormatError(
                f"a HiAI (Kirin NPU) model, not Ascend ATC output: its header carries HiAI fields and its "
                f"partitions are not GE's ({error})"
            ) from None
        raise
    if MODEL_INOUT_INFO in partitions:
        contents = parse_inout_info(_read(stream, *partitions[MODEL_INOUT_INFO]))
        contents.soc_version = graph.soc_version if graph is not None else None
        if not contents.dynamic_output_dims and graph is not None:
            # GE writes the record from the NetOutput's attribute; a file with only the attribute still has it.
            contents.dynamic_output_dims = graph.dynamic_output_dims
    else:
        assert graph is not None
        contents = graph
    return assemble(contents, header.name, header.version)


def _header(head: bytes, size: int) -> OmHeader:
    if len(head) < HEADER_SIZE:
        raise OmFormatError(f"truncated: {size} bytes, shorter than the {HEADER_SIZE}-byte header")
    headsize, version = struct.unpack_from("<II", head, 4)
    if version not in (VERSION_1, VERSION_2):
        raise OmFormatError(f"unknown header version {version:#010x} (known: 0x10000000, 0x20000000)")
    if headsize != HEADER_SIZE:
        raise OmFormatError(f"header size {headsize}, not {HEADER_SIZE}")
    (length,) = struct.unpack_from("<I", head, 76)
    is_encrypt, _checksum, model_type = head[80], head[81], head[82]
    name = head[84:116].split(b"\0", 1)[0].decode("utf-8", "replace")
    model_num, model_length = 1, 0
    if version >= VERSION_2:
        (model_num,) = struct.unpack_from("<I", head, 156)
        (model_length,) = struct.unpack_from("<Q", head, 184)
    header = OmHeader(version, length, is_encrypt, model_type, name, model_num, model_length)
    if is_encrypt:
        raise OmFormatError(f"model '{name}' is encrypted (is_encrypt={is_encrypt}); it cannot be read without its key")
    if model_type == MODEL_TYPE_BUNDLE:
        raise OmFormatError(f"'{name}' is a bundle of models (model type 5); serve each of its models on its own")
    body = model_length or length
    if body != size - HEADER_SIZE:
        state = "truncated" if body > size - HEADER_SIZE else "has trailing data"
        raise OmFormatError(f"{state}: the header says {body} bytes follow it, the file has {size - HEADER_SIZE}")
    return header


def _partition_table(stream: BinaryIO, header: OmHeader, size: int) -> list[tuple[int, tuple[int, int]]]:
    """(type, (offset, size)) of the first model's partitions, walked by size as GE's loader does.
    A root model with sub-models has one table per model; the first holds the root graph."""
    entry = struct.Struct("<IIQQ" if header.wide_table else "<III")
    prefix = 8 if header.wide_table else 4
    stream.seek(HEADER_SIZE)
    table = Cursor(stream.read(min(size - HEADER_SIZE, prefix + entry.size * 64)), "the partition table")
    count = table.count(entry.size)
    table.take(prefix - 4)
    if count == 0:
        raise OmFormatError("the partition table is empty")
    if count > 64:
        raise OmFormatError(f"the partition table claims {count} partitions")
    offset = HEADER_SIZE + prefix + entry.size * count
    entries = []
    for _ in range(count):
        fields = table.unpack(entry)
        kind, length = fields[0], fields[-1]
        if offset + length > size:
            raise OmFormatError(f"truncated: partition {kind} ({length} bytes at {offset}) runs past the end ({size})")
        entries.append((kind, (offset, length)))
        offset += length
    return entries


def _read(stream: BinaryIO, offset: int, length: int) -> bytes:
    stream.seek(offset)
    data = stream.read(length)
    if len(data) != length:
        raise OmFormatError(f"truncated: {length} bytes wanted at {offset}, {len(data)} read")
    return data


def _looks_encrypted(sample: bytes) -> bool:
    """Ciphertext is near 8 bits of entropy per byte; headers and protobufs are far below."""
    if len(sample) < 256:
        return False
    counts = Counter(sample)
    entropy = -sum(n / len(sample) * math.log2(n / len(sample)) for n in counts.values())
    return entropy > 7.0


def assemble(contents: OmContents, name: str, header_version: int | None) -> OmDescription:
    """One description from what the file says: the gear input set apart, batch gears sorted."""
    dynamic = next((t for t in contents.inputs if t.name == DYNAMIC_TENSOR_NAME), None)
    gears: tuple[int, ...] = ()
    if contents.gear_kind == GEAR_BATCH:
        if any(len(shape) != 1 for shape in contents.gear_shapes):
            raise OmFormatError(f"batch gears {contents.gear_shapes} are not one value each")
        gears = tuple(sorted(shape[0] for shape in contents.gear_shapes))
        if not gears or gears[0] <= 0:
            raise OmFormatError(f"batch gears {list(gears)} are not positive sizes")
    largest = max(gears, default=0)
    inputs = tuple(resolve_input_dims(t, largest) for t in contents.inputs if t.name != DYNAMIC_TENSOR_NAME)
    return OmDescription(
        inputs,
        tuple(contents.outputs),
        gears,
        dynamic,
        name=name,
        soc_version=contents.soc_version,
        header_version=header_version,
        gear_kind=contents.gear_kind,
        gear_shapes=tuple(tuple(shape) for shape in contents.gear_shapes),
        data_name_order=tuple(contents.data_name_order),
        dynamic_output_dims=tuple(contents.dynamic_output_dims) if contents.dynamic_output_dims is not None else None,
    )


# -- OM2: a zip archive whose model_meta.json holds the I/O description --------------------------


def _describe_om2(stream: BinaryIO) -> OmDescription:
    stream.seek(0)
    try:
        with zipfile.ZipFile(stream) as archive:
            metas = sorted((i for i in archive.infolist() if i.filename.endswith("model_meta.json")), key=_depth)
            if not metas:
                raise OmFormatError("an OM2 archive without model_meta.json")
            if metas[0].file_size > _MAX_META_BYTES:
                raise OmFormatError(f"an OM2 archive whose model_meta.json is {metas[0].file_size} bytes")
            meta = json.loads(archive.read(metas[0]))
        return _om2_description(meta)
    except OmFormatError:
        raise
    except Exception as error:  # zipfile and json raise many kinds on a damaged archive
        raise OmFormatError(f"a damaged OM2 archive ({type(error).__name__}: {error})") from None


def _depth(info: zipfile.ZipInfo) -> int:
    return info.filename.count("/")


def _om2_description(meta: Any) -> OmDescription:
    if not isinstance(meta, dict):
        raise OmFormatError("model_meta.json is not an object")
    contents = OmContents()
    contents.inputs = [_om2_tensor(entry, index) for index, entry in enumerate(_list(meta, "inputs"))]
    contents.outputs = [_om2_tensor(entry, index) for index, entry in enumerate(_list(meta, "outputs"))]
    gears = [tuple(int(v) for v in gear) for gear in _list(meta, "dynamic_batch_info")]
    if gears:
        contents.gear_kind = _OM2_GEAR_KINDS.get(int(meta.get("dynamic_type", 1)), GEAR_DIMS)
        contents.gear_shapes = gears
    contents.data_name_order = [str(name) for name in _list(meta, "user_designate_shape_order")]
    return assemble(contents, str(meta.get("name", "")), None)


def _om2_tensor(entry: Any, index: int) -> OmTensor:
    if not isinstance(entry, dict):
        raise OmFormatError("a tensor entry of model_meta.json is not an object")
    dims = entry.get("origin_input_dims") or entry.get("shape") or []
    # "shape_v2" is the static-AIPP `input_dims` attr where there is one, else the (largest gear's) shape
    # (G1 om2 packager): only a value other than the shape says anything.
    shape_v2 = entry.get("shape_v2") or []
    dims_v2 = tuple(int(d) for d in shape_v2) if shape_v2 != entry.get("shape") else ()
    return OmTensor(
        str(entry["name"]),
        index,
        int(entry.get("data_type", -1)),
        tuple(int(d) for d in dims),
        int(entry.get("size", 0)),
        format_name(int(entry.get("format", 2))),
        dims_v2=dims_v2,
    )


def _list(meta: dict[str, Any], key: str) -> list[Any]:
    value = meta.get(key) or []
    if not isinstance(value, list):
        raise OmFormatError(f"model_meta.json '{key}' is not a list")
    return value
