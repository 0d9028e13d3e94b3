"""What the simulator makes of an `.om` file: its description, from a source other than geserve's reader, and how to run it.

A real ATC sample (tests/data/om-samples/, found by the file's sha256) is described by its entry in
that folder's expected.json, which was derived from the files independently of geserve; a file of
tests/fakes/om_writer.py by the record the writer left in its TASK_INFO partition: the description it
was asked to lay out. Neither goes through geserve's offline reader, so a test that compares what
pyACL answers with what the reader says compares two sources. Any other file fails to load.

A model runs with its ONNX twin when the test supplies one (`<file>.twin.onnx` beside the `.om`: the
model it was compiled from), else with deterministic outputs of the described shape: every element of
row r of every output is the sum of row r of the first input (the whole tensor's sum without a batch),
so each response can still be checked.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

TWIN_SUFFIX = ".twin.onnx"
SAMPLES = Path(__file__).resolve().parents[2] / "data" / "om-samples"
# Must equal tests/fakes/om_writer.py's SIM_RECORD_MAGIC (the simulator is imported as `acl`, apart from tests/).
RECORD_MAGIC = b"GESERVE-OM-WRITER-RECORD\0"
# What the samples' files say that expected.json does not hold: the NetOutput op's `_dynamic_output_dims`
# strings, as the file carries them (tests/unit/test_om_samples.py checks them against the bytes).
SAMPLE_DYNAMIC_OUTPUT_DIMS: dict[str, list[str]] = {
    "synthetic_dynbatch.om": ["0,1,1000", "1,2,1000", "2,4,1000", "3,8,1000"],
}
# aclDataType and aclFormat numbers (pyacl.md §3.1, from acl_base_rt.h) of the names descriptions use.
ACL_TYPES = {
    "float32": 0, "float16": 1, "int8": 2, "int32": 3, "uint8": 4, "int16": 6, "uint16": 7, "uint32": 8,
    "int64": 9, "uint64": 10, "float64": 11, "bool": 12, "string": 13, "complex64": 16, "complex128": 17,
    "bfloat16": 27, "int4": 29,
}  # fmt: skip
ACL_FORMATS = {
    "NCHW": 0, "NHWC": 1, "ND": 2, "NC1HWC0": 3, "FRACTAL_Z": 4, "NC1HWC0_C04": 12, "HWCN": 16, "NDHWC": 27,
    "FRACTAL_NZ": 29, "NCDHW": 30, "NDC1HWC0": 32, "FRACTAL_Z_3D": 33, "NC": 35, "NCL": 47,
}  # fmt: skip
GEAR_KINDS = ("dynamic_batch", "dynamic_image_size", "dynamic_dims")


def twin_path(om_path: Path) -> Path:
    return om_path.with_name(om_path.name.removesuffix(".om") + TWIN_SUFFIX)


@dataclass
class OmModel:
    """One loaded file, in the simulator's terms: tensors as dicts at their runtime indexes."""

    name: str
    inputs: list[dict[str, Any]]  # the gear input included, at its index
    outputs: list[dict[str, Any]]
    gears: list[int]  # batch gears in the file's order (the Case op's _pred_value_<i>), or []
    gear_kind: str  # one of GEAR_KINDS, or "" for a static model
    gear_shapes: list[list[int]]  # every gear's values, for any kind
    dynamic_output_dims: list[list[int]]  # `_dynamic_output_dims` as pyACL parses it: [gear, output, *dims]
    session: Any  # onnxruntime session of the twin, or None
    twin_outputs: list[str]  # the twin's output name for each .om output
    file_bytes: int


def load(path: Path) -> OmModel:
    """ValueError when the simulator does not know the file (or knows it cannot be loaded)."""
    data = path.read_bytes()
    sample = _samples().get(hashlib.sha256(data).hexdigest())
    if sample is not None:
        description = _expected()[sample]
        if "error" in description:
            raise ValueError(str(description["error"]))
        output_dims = SAMPLE_DYNAMIC_OUTPUT_DIMS.get(sample)
    else:
        record = _record(data)
        if record is None:
            raise ValueError(
                "not a model the simulator knows: neither a sample of tests/data/om-samples nor a file written by "
                "tests/fakes/om_writer.py"
            )
        description, output_dims = record["description"], record["dynamic_output_dims"]
    inputs = [_tensor(t) for t in description["inputs"]]
    outputs = [_tensor(t) for t in description["outputs"]]
    dynamic = description.get("dynamic") or {}
    kind = next((key for key in GEAR_KINDS if key in dynamic), "")
    shapes = [[v] if kind == "dynamic_batch" else list(v) for v in dynamic.get(kind, [])]
    gears = [shape[0] for shape in shapes] if kind == "dynamic_batch" else []
    session, twin_outputs = None, []
    twin = twin_path(path)
    if twin.is_file():
        session = _session(twin)
        twin_outputs = _match_twin_outputs([t["name"] for t in outputs], [o.name for o in session.get_outputs()])
    return OmModel(
        str(description.get("name", "")),
        inputs,
        outputs,
        gears,
        kind,
        shapes,
        [parse_output_dims(entry) for entry in output_dims or []],
        session,
        twin_outputs,
        len(data),
    )


@cache
def _expected() -> dict[str, Any]:
    result: dict[str, Any] = json.loads((SAMPLES / "expected.json").read_text())
    return result


@cache
def _samples() -> dict[str, str]:
    """sha256 of each sample file -> its name in expected.json."""
    return {hashlib.sha256((SAMPLES / name).read_bytes()).hexdigest(): name for name in _expected()}


def _record(data: bytes) -> dict[str, Any] | None:
    start = data.find(RECORD_MAGIC)
    if start < 0:
        return None
    start += len(RECORD_MAGIC)
    try:
        (length,) = struct.unpack_from("<I", data, start)
        record: dict[str, Any] = json.loads(data[start + 4 : start + 4 + length])
    except (struct.error, ValueError):
        return None
    return record


def parse_output_dims(entry: str) -> list[int]:
    """One `_dynamic_output_dims` string as pyACL reads it: digits make a number, '-' negates it, any
    other character ends it (hicann/ge api/acl/acl_model/model/model_common.cpp `GetModelOutputShapeInfoHelp`)."""
    values: list[int] = []
    value, sign = 0, 1
    for char in entry:
        if char.isdigit():
            value = value * 10 + int(char)
        elif char == "-":
            sign = -1
        else:
            values.append(value * sign)
            value, sign = 0, 1
    values.append(value * sign)
    return values


def _tensor(tensor: dict[str, Any]) -> dict[str, Any]:
    described = {
        "name": tensor["name"],
        "dtype": ACL_TYPES.get(tensor["dtype"], -1),
        "format": ACL_FORMATS.get(tensor["format"], -1),
        "dims": list(tensor["dims"]),
    }
    if "dims_v2" in tensor:
        # Static AIPP: get_input_dims gives the image's dims, get_input_dims_v2 and the size the buffer's
        # (CANN docs, aclmdlGetInputDimsV2).
        described["dims"] = list(tensor["dims_v2"])
        described["dims_v1"], described["dims_v2"] = list(tensor["dims"]), list(tensor["dims_v2"])
    return described


def _session(path: Path) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])


def _match_twin_outputs(om_names: list[str], twin_names: list[str]) -> list[str]:
    """The twin output behind each ATC-named output: same name, the name ATC kept (the ONNX name of
    `<node>:<index>:<onnx name>`, the node of `<node>:<index>`), or position."""
    matched = []
    for index, full in enumerate(om_names):
        parts = full.split(":", 2)
        short = None
        if len(parts) > 1 and parts[1].isdigit():
            short = parts[2] if len(parts) == 3 else parts[0]
        if full in twin_names:
            matched.append(full)
        elif short is not None and short in twin_names:
            matched.append(short)
        else:
            matched.append(twin_names[index])
    return matched


def run(model: OmModel, feeds: dict[str, np.ndarray], numpy_types: dict[int, Any]) -> list[np.ndarray]:
    """Each output's values, in output order, at the shapes the feeds imply."""
    if model.session is not None:
        results = model.session.run(model.twin_outputs, feeds)
        return [np.asarray(r) for r in results]
    first = next(iter(feeds.values()))
    batch = first.shape[0] if model.gears or _batched(model, first) else None
    outputs = []
    for tensor in model.outputs:
        dtype = numpy_types[tensor["dtype"]]
        dims = list(tensor["dims"])
        if batch is not None:
            # numpy's own accumulator (float32 for float32 rows): a float64 one costs 5x on image-sized rows
            sums = first.reshape(batch, -1).sum(axis=1)
            dims[0] = batch
            value = np.broadcast_to(sums.reshape([batch] + [1] * (len(dims) - 1)), dims)
        else:
            value = np.full(dims, first.sum())
        outputs.append(np.ascontiguousarray(value).astype(dtype))
    return outputs


def _batched(model: OmModel, first: np.ndarray) -> bool:
    """A static model whose outputs share the first input's leading dim is run row by row."""
    return first.ndim > 0 and all(t["dims"] and t["dims"][0] == first.shape[0] for t in model.outputs)
