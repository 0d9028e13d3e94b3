"""The simulator's stand-in for an ATC-compiled `.om` file: a description, the gears and an ONNX graph.

Layout: MAGIC, a 4-byte little-endian length, that many bytes of JSON description, then the ONNX
model bytes. The simulator runs the graph with onnxruntime, so outputs are real computations.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

MAGIC = b"GESIM-OM1\x00"
FORMAT_ND = 2
FORMAT_NCHW = 0


def tensor(name: str, dtype: int, dims: list[int], fmt: int = FORMAT_ND) -> dict[str, Any]:
    """One input or output as ATC records it: name, aclDataType, aclFormat and dims (-1: batch gear)."""
    return {"name": name, "dtype": dtype, "format": fmt, "dims": list(dims)}


def write_om(
    path: Path,
    onnx_model: bytes,
    inputs: list[dict[str, Any]],
    outputs: list[dict[str, Any]],
    dynamic_batch: list[int] | None = None,
    soc_version: str = "Ascend310P3",
) -> Path:
    """Write a simulated `.om`; `dynamic_batch` lists the gears as ATC's --dynamic_batch_size."""
    description = {
        "inputs": inputs,
        "outputs": outputs,
        "dynamic_batch": sorted(dynamic_batch or []),
        "soc_version": soc_version,
    }
    header = json.dumps(description).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(MAGIC + struct.pack("<I", len(header)) + header + onnx_model)
    return path


def read_om(data: bytes) -> tuple[dict[str, Any], bytes]:
    """The description and the ONNX bytes; ValueError when `data` is not a simulated `.om`."""
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 4:
        raise ValueError("not an offline model file")
    start = len(MAGIC) + 4
    (length,) = struct.unpack("<I", data[len(MAGIC) : start])
    description = json.loads(data[start : start + length])
    return description, data[start + length :]
