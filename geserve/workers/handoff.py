"""Batch outputs left in shared memory for a pipeline's next step: mapped, not copied, and passed on by reference."""

from __future__ import annotations

import mmap
import os
import weakref
from collections.abc import Sequence

import numpy as np

from geserve.backends.base import RequestResult
from geserve.codecs import bytes as bytes_codec
from geserve.codecs import dtypes
from geserve.errors import GeserveError
from geserve.workers.messages import PlacedResult
from geserve.workers.shm import TensorRef, unlink_quietly

_SHM_DIR = "/dev/shm"
# The mapping of each segment still in use, by id: segment name and a weak reference to the mapping's array.
_MAPPED: dict[int, tuple[str, weakref.ref[np.ndarray]]] = {}


def map_results(blocks: Sequence[TensorRef], placed: Sequence[PlacedResult]) -> tuple[RequestResult, ...]:
    """Each request's outputs as views of the segment the worker wrote them to: nothing is copied (BYTES are
    decoded). The segment is unlinked once no view of it is left."""
    arrays = _map_blocks(blocks)
    results: list[RequestResult] = []
    for result in placed:
        if isinstance(result, GeserveError):
            results.append(result)
            continue
        outputs = {}
        for block, first, rows in result:
            array = arrays[block]
            outputs[blocks[block].name] = array if rows < 0 else array[first : first + rows]
        results.append(outputs)
    return tuple(results)


def _map_blocks(blocks: Sequence[TensorRef]) -> list[np.ndarray]:
    mappings: dict[str, np.ndarray] = {}
    for name in dict.fromkeys(block.segment for block in blocks):
        descriptor = os.open(os.path.join(_SHM_DIR, name), os.O_RDWR)
        try:
            whole = np.frombuffer(mmap.mmap(descriptor, 0), dtype=np.uint8)
        finally:
            os.close(descriptor)
        _MAPPED[id(whole)] = (name, weakref.ref(whole))
        weakref.finalize(whole, _forget, id(whole), name)
        mappings[name] = whole
    arrays = []
    for block in blocks:
        data = mappings[block.segment][block.offset : block.offset + block.nbytes]
        if block.datatype == "BYTES":
            arrays.append(bytes_codec.deserialize(data.tobytes()).reshape(block.shape))
        else:
            arrays.append(data.view(dtypes.from_wire(block.datatype).numpy).reshape(block.shape))
    return arrays


def _forget(key: int, name: str) -> None:
    """The last view of a mapped segment is gone: the mapping goes with it, and so does the segment."""
    _MAPPED.pop(key, None)
    unlink_quietly(name)


def ref_of(array: np.ndarray) -> TensorRef | None:
    """Where a view `map_results` made lies in shared memory, so that a worker can read it in place; None for
    any other array (or one that is not contiguous)."""
    base = array.base
    if not isinstance(base, np.ndarray) or array.dtype.kind == "O" or not array.flags.c_contiguous:
        return None
    entry = _MAPPED.get(id(base))
    if entry is None or entry[1]() is not base:
        return None
    offset = array.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    return TensorRef("", dtypes.from_numpy(array.dtype).wire, tuple(array.shape), offset, array.nbytes, entry[0])
