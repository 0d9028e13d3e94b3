"""Tensor arenas in shared memory: segments with unguessable names, and tensors laid out in them."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path
from typing import NamedTuple

import numpy as np

from geserve.codecs import bytes as bytes_codec
from geserve.codecs import dtypes
from geserve.errors import UnavailableError

logger = logging.getLogger(__name__)

# Every segment geserve creates starts with this (then its run's id: runs.RunId); the client shared-memory
# API refuses it.
SHM_PREFIX = "geserve_"
SHM_DIRECTORY = Path("/dev/shm")
# The role (last part of the name) of a protocol process's request arena, numbered by the process.
REQUEST_ARENA_ROLE = "requests"
_ALIGNMENT = 64


def create_segment(name: str, size: int) -> shared_memory.SharedMemory:
    """Create a segment with all its pages reserved up front, so that running out of /dev/shm is a
    clear error here rather than a SIGBUS in whichever process writes first."""
    segment = shared_memory.SharedMemory(name=name, create=True, size=max(size, 1))
    try:
        os.posix_fallocate(segment._fd, 0, max(size, 1))  # type: ignore[attr-defined]
    except OSError as error:
        discard(segment)
        if error.errno in (errno.ENOSPC, errno.ENOMEM):
            raise UnavailableError(
                f"not enough shared memory for {size} bytes of tensors (/dev/shm is full or too small)"
            ) from None
        raise
    return segment


def attach_segment(name: str) -> shared_memory.SharedMemory:
    return shared_memory.SharedMemory(name=name, create=False)


def attach_foreign_segment(name: str) -> shared_memory.SharedMemory:
    """Attach a segment another process creates and removes (a protocol process's request arena): this
    process's resource tracker must not count it as leaked, or remove it, when this process ends."""
    segment = attach_segment(name)
    with contextlib.suppress(Exception):  # the tracker's internals vary by Python version
        resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
    return segment


def buffer_of(segment: shared_memory.SharedMemory) -> memoryview:
    buffer = segment.buf
    if buffer is None:
        raise UnavailableError(f"shared memory segment {segment.name} is closed")
    return buffer


def discard(segment: shared_memory.SharedMemory) -> None:
    """Close and unlink a segment this process is done with. One that is already unlinked (after a crash, or
    twice on shutdown) is fine; so is one a view still holds: its mapping goes with the last view."""
    with contextlib.suppress(BufferError):
        segment.close()
    with contextlib.suppress(FileNotFoundError):
        segment.unlink()


def unlink_quietly(name: str) -> None:
    """Remove a segment by name that may already be gone."""
    try:
        segment = shared_memory.SharedMemory(name=name, create=False)
    except FileNotFoundError:
        return
    discard(segment)


def align(size: int) -> int:
    return (size + _ALIGNMENT - 1) // _ALIGNMENT * _ALIGNMENT


class TensorRef(NamedTuple):
    """Where a tensor lies: in shared-memory `segment` at `offset`; BYTES tensors are framed. A named tuple:
    every batch message carries some, and tuples pickle several times faster than frozen dataclasses."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    segment: str


def read_tensor(buffer: memoryview, ref: TensorRef) -> np.ndarray:
    """A zero-copy view of a numeric tensor, or the decoded elements of a BYTES tensor."""
    if ref.datatype == "BYTES":
        return bytes_codec.deserialize(buffer[ref.offset : ref.offset + ref.nbytes]).reshape(ref.shape)
    dtype = dtypes.from_wire(ref.datatype).numpy
    return np.ndarray(ref.shape, dtype=dtype, buffer=buffer, offset=ref.offset)


@dataclass(slots=True)
class _Planned:
    name: str
    datatype: str
    shape: tuple[int, ...]
    parts: Sequence[np.ndarray] | bytes
    nbytes: int


class TensorLayout:
    """Tensors to write (each possibly in several row blocks), their offsets, and the total size."""

    def __init__(self) -> None:
        self._planned: list[_Planned] = []
        self.size = 0

    @property
    def count(self) -> int:
        return len(self._planned)

    def add(self, name: str, datatype: str, parts: Sequence[np.ndarray]) -> None:
        """Plan one tensor made of `parts` concatenated along the first dim (or a single part)."""
        shape = tuple(parts[0].shape)
        if len(parts) > 1:
            shape = (sum(int(p.shape[0]) for p in parts), *shape[1:])
        if datatype == "BYTES":
            framed = b"".join(bytes_codec.serialize(part) for part in parts)
            planned = _Planned(name, datatype, shape, framed, len(framed))
        else:
            planned = _Planned(name, datatype, shape, parts, sum(int(p.nbytes) for p in parts))
        self._planned.append(planned)
        self.size += align(planned.nbytes)

    def write(self, buffer: memoryview, segment: str, start: int = 0) -> tuple[TensorRef, ...]:
        """Copy every planned tensor into `buffer` from offset `start`: the one copy that is also the
        batch's concatenation."""
        refs = []
        offset = start
        for planned in self._planned:
            if isinstance(planned.parts, bytes):
                buffer[offset : offset + planned.nbytes] = planned.parts
            else:
                dtype = planned.parts[0].dtype.newbyteorder("=")
                target = np.ndarray(planned.shape, dtype=dtype, buffer=buffer, offset=offset)
                if len(planned.parts) == 1:
                    np.copyto(target, planned.parts[0], casting="equiv")
                else:
                    row = 0
                    for part in planned.parts:
                        np.copyto(target[row : row + part.shape[0]], part, casting="equiv")
                        row += int(part.shape[0])
                del target  # views must not outlive the write, or the segment cannot be closed
            refs.append(TensorRef(planned.name, planned.datatype, planned.shape, offset, planned.nbytes, segment))
            offset += align(planned.nbytes)
        return tuple(refs)


def write_tensors(arrays: Mapping[str, np.ndarray], name: str) -> tuple[TensorRef, ...]:
    """Tensors in a segment of their own named `name`, which the reader unlinks (`take_tensors`); () for none."""
    if not arrays:
        return ()
    layout = TensorLayout()
    for tensor, array in arrays.items():
        layout.add(tensor, dtypes.from_numpy(array.dtype).wire, [np.ascontiguousarray(array)])
    segment = create_segment(name, layout.size)
    try:
        return layout.write(buffer_of(segment), segment.name)
    finally:
        segment.close()


def take_tensors(refs: Sequence[TensorRef]) -> dict[str, np.ndarray]:
    """Copies of tensors `write_tensors` placed, their segment unlinked once read."""
    arrays: dict[str, np.ndarray] = {}
    for name in dict.fromkeys(ref.segment for ref in refs):
        segment = attach_segment(name)
        try:
            buffer = buffer_of(segment)
            for ref in refs:
                if ref.segment == name:
                    arrays[ref.name] = np.array(read_tensor(buffer, ref), copy=True)
            del buffer
        finally:
            discard(segment)
    return arrays
