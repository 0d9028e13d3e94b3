"""The one dtype table: wire name <-> config enum <-> numpy dtype <-> ONNX type name <-> ACL enum."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from geserve._generated import model_config_pb2 as mc
from geserve.errors import InvalidArgumentError


@dataclass(frozen=True, slots=True)
class DataType:
    """One tensor element type under each of its names."""

    wire: str  # KServe v2 datatype string ("INT32", "BYTES", ...)
    config: int  # inference.DataType enum value (TYPE_INT32, TYPE_STRING, ...)
    numpy: np.dtype[np.generic]  # object for BYTES; BF16 travels as its raw 16 bits
    onnx: str  # ONNX Runtime's element type name, as in "tensor(<onnx>)"
    acl: int  # aclDataType (acl_base_rt.h); ACL_STRING for BYTES

    @property
    def itemsize(self) -> int | None:
        """Bytes per element, or None for variable-size BYTES."""
        return None if self.wire == "BYTES" else self.numpy.itemsize

    @property
    def config_name(self) -> str:
        return mc.DataType.Name(self.config)  # type: ignore[arg-type]


_TABLE = (
    DataType("BOOL", mc.TYPE_BOOL, np.dtype(np.bool_), "bool", 12),
    DataType("UINT8", mc.TYPE_UINT8, np.dtype(np.uint8), "uint8", 4),
    DataType("UINT16", mc.TYPE_UINT16, np.dtype(np.uint16), "uint16", 7),
    DataType("UINT32", mc.TYPE_UINT32, np.dtype(np.uint32), "uint32", 8),
    DataType("UINT64", mc.TYPE_UINT64, np.dtype(np.uint64), "uint64", 10),
    DataType("INT8", mc.TYPE_INT8, np.dtype(np.int8), "int8", 2),
    DataType("INT16", mc.TYPE_INT16, np.dtype(np.int16), "int16", 6),
    DataType("INT32", mc.TYPE_INT32, np.dtype(np.int32), "int32", 3),
    DataType("INT64", mc.TYPE_INT64, np.dtype(np.int64), "int64", 9),
    DataType("FP16", mc.TYPE_FP16, np.dtype(np.float16), "float16", 1),
    DataType("FP32", mc.TYPE_FP32, np.dtype(np.float32), "float", 0),
    DataType("FP64", mc.TYPE_FP64, np.dtype(np.float64), "double", 11),
    DataType("BYTES", mc.TYPE_STRING, np.dtype(np.object_), "string", 13),
    DataType("BF16", mc.TYPE_BF16, np.dtype(np.uint16), "bfloat16", 27),
)

_BY_WIRE = {d.wire: d for d in _TABLE}
_BY_CONFIG = {d.config: d for d in _TABLE}
_BY_ONNX = {d.onnx: d for d in _TABLE}
_BY_ACL = {d.acl: d for d in _TABLE}
# BF16 shares uint16 storage; numpy lookups must find UINT16.
_BY_NUMPY = {d.numpy: d for d in reversed(_TABLE)}
for _kind in ("S", "U"):
    _BY_NUMPY[np.dtype(_kind)] = _BY_WIRE["BYTES"]


def all_types() -> tuple[DataType, ...]:
    return _TABLE


def from_wire(name: str) -> DataType:
    """Look up a KServe datatype string; unknown names are a client error."""
    try:
        return _BY_WIRE[name]
    except KeyError:
        raise InvalidArgumentError(f"invalid datatype '{name}'") from None


def from_config(value: int) -> DataType:
    """Look up an inference.DataType enum value (TYPE_INVALID has no entry)."""
    try:
        return _BY_CONFIG[value]
    except KeyError:
        raise InvalidArgumentError(f"invalid data type {value}") from None


def from_onnx(name: str) -> DataType | None:
    """Look up ONNX Runtime's "tensor(<type>)" string; None for types Triton cannot serve."""
    inner = name.removeprefix("tensor(").removesuffix(")")
    return _BY_ONNX.get(inner)


def from_acl(value: int) -> DataType | None:
    """Look up an aclDataType enum value; None for types Triton cannot serve (e.g. INT4, complex)."""
    return _BY_ACL.get(value)


def from_numpy(dtype: np.dtype[np.generic]) -> DataType:
    """Look up a numpy dtype (bytes/str/object arrays are BYTES)."""
    key = np.dtype(dtype.kind) if dtype.kind in "SU" else dtype.newbyteorder("=")
    try:
        return _BY_NUMPY[key]
    except KeyError:
        raise InvalidArgumentError(f"unsupported numpy dtype '{dtype}'") from None


def fits(datatype: DataType, smallest: float, largest: float) -> bool:
    """Whether integers from `smallest` to `largest` fit `datatype` (always true for other kinds)."""
    if datatype.numpy.kind not in "iu":
        return True
    limits = np.iinfo(datatype.numpy.name)
    return bool(limits.min <= smallest and largest <= limits.max)
