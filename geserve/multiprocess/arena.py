"""The request arena: a protocol process's shared segment its request tensors lie in, seen by the engine by offset."""

# HTTP bodies are read into it from the socket; other large inputs are copied there once.

from __future__ import annotations

import bisect
import collections
import contextlib
import ctypes
import errno
import logging
import mmap
import os
import threading
import weakref
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from geserve.errors import UnavailableError
from geserve.residency import SHM_DIRECTORY, Kind, Residency, SharedTensor
from geserve.types import InferRequest

logger = logging.getLogger(__name__)

DEFAULT_ARENA_BYTES = 32 << 20
_ALIGNMENT = 64


@dataclass(frozen=True, slots=True)
class ArenaRef:
    """Where one tensor's bytes lie in a protocol process's arena (`segment`)."""

    segment: str
    offset: int
    nbytes: int


class RequestArena:
    """A segment of `size` bytes with a first-fit allocator. A block is free again once no view of it is left
    (the request is answered and dropped); a full arena is not an error: the caller sends the bytes instead."""

    def __init__(self, name: str, size: int = DEFAULT_ARENA_BYTES) -> None:
        self.name = name  # the supervisor's choice: it removes the segment when this process is gone
        self._mapping = _create_mapping(SHM_DIRECTORY / name, size)
        self._whole = np.frombuffer(self._mapping, dtype=np.uint8)
        self._start = int(self._whole.__array_interface__["data"][0])
        self._size = size
        self._lock = threading.Lock()  # grpc's threads may allocate too
        self._free: list[tuple[int, int]] = [(0, size)]  # (offset, length), sorted by offset
        self._returned: collections.deque[tuple[int, int]] = collections.deque()

    def close(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            (SHM_DIRECTORY / self.name).unlink()

    def allocate(self, nbytes: int) -> np.ndarray | None:
        """A block of `nbytes` (uint8), or None when none is free."""
        length = max(-(-nbytes // _ALIGNMENT) * _ALIGNMENT, _ALIGNMENT)
        with self._lock:
            self._take_back()
            for index, (offset, free) in enumerate(self._free):
                if free >= length:
                    if free == length:
                        del self._free[index]
                    else:
                        self._free[index] = (offset + length, free - length)
                    break
            else:
                return None
        # The block views an object of its own that exports the region, which every view of the block (numpy or
        # buffer) keeps alive: the region comes back once the last of them is gone. (A slice of the whole array,
        # or of a memoryview, would not do: numpy gives views of those the mapping as their base.)
        region = (ctypes.c_char * max(nbytes, 1)).from_buffer(self._mapping, offset)
        weakref.finalize(region, self._returned.append, (offset, length))
        block: np.ndarray = np.frombuffer(memoryview(region).cast("B"), dtype=np.uint8, count=nbytes)
        return block

    def _take_back(self) -> None:
        """Merge the blocks whose last view died into the free list. Blocks come back through a deque, never
        under the lock: the garbage collector may free one while this very thread holds it."""
        while self._returned:
            offset, length = self._returned.popleft()
            index = bisect.bisect(self._free, (offset, length))
            if index < len(self._free) and self._free[index][0] == offset + length:
                length += self._free.pop(index)[1]
            if index > 0 and sum(self._free[index - 1]) == offset:
                offset, previous = self._free.pop(index - 1)
                length += previous
                index -= 1
            self._free.insert(index, (offset, length))

    def ref_of(self, view: memoryview) -> ArenaRef | None:
        """Where `view` lies in this arena; None when it is memory of its own."""
        if not view.contiguous or view.nbytes == 0:
            return None
        address = int(np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0])
        offset = address - self._start
        if offset < 0 or offset + view.nbytes > self._size:
            return None
        return ArenaRef(self.name, offset, view.nbytes)

    def place(self, view: memoryview) -> tuple[ArenaRef, np.ndarray] | None:
        """`view`'s bytes copied into a block (which the caller keeps until the engine answered); None when
        the arena is full."""
        block = self.allocate(view.nbytes)
        if block is None:
            return None
        block[:] = np.frombuffer(view, dtype=np.uint8)
        offset = int(block.__array_interface__["data"][0]) - self._start
        return ArenaRef(self.name, offset, view.nbytes), block


def _create_mapping(path: Path, size: int) -> mmap.mmap:
    """A new segment with its pages reserved (a full /dev/shm is an error here, not a SIGBUS later), mapped.
    Plain file calls: multiprocessing's SharedMemory would register it with a resource tracker that then
    reports it leaked when the supervisor removes it."""
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.posix_fallocate(descriptor, 0, size)
        except OSError as error:
            path.unlink()
            if error.errno in (errno.ENOSPC, errno.ENOMEM):
                raise UnavailableError(f"not enough shared memory for a request arena of {size} bytes") from None
            raise
        return mmap.mmap(descriptor, size)
    finally:
        os.close(descriptor)


# Inputs smaller than this travel in the message: a copy of a few KiB costs less than a block.
PLACE_MIN_BYTES = 16 << 10
RAW_BODY = -1  # the index of a raw binary body among an arena request's refs
ArenaRefs = tuple[tuple[int, ArenaRef], ...]  # (input index or RAW_BODY, where its bytes are)


def to_engine(request: InferRequest, arena: RequestArena) -> tuple[InferRequest, ArenaRefs, list[Any]]:
    """The request as it crosses to the engine: each large byte input replaced by where it lies in the arena
    (placed there now unless it was read into it); returns what must stay alive until the engine answers."""
    refs: list[tuple[int, ArenaRef]] = []
    keep: list[Any] = [request]
    inputs = list(request.inputs)
    for index, tensor in enumerate(request.inputs):
        if isinstance(tensor.data, memoryview) and tensor.data.nbytes >= PLACE_MIN_BYTES:
            ref = _in_arena(tensor.data, arena, keep)
            if ref is not None:
                refs.append((index, ref))
                inputs[index] = replace(tensor, data=_EMPTY)
    raw = request.raw_body
    if isinstance(raw, memoryview) and raw.nbytes >= PLACE_MIN_BYTES:
        ref = _in_arena(raw, arena, keep)
        if ref is not None:
            refs.append((RAW_BODY, ref))
            raw = _EMPTY
    if not refs:
        return request, (), keep
    return replace(request, inputs=tuple(inputs), raw_body=raw), tuple(refs), keep


def _in_arena(view: memoryview, arena: RequestArena, keep: list[Any]) -> ArenaRef | None:
    ref = arena.ref_of(view)
    if ref is not None:
        return ref
    placed = arena.place(view)
    if placed is None:
        return None
    keep.append(placed[1])
    return placed[0]


_EMPTY = memoryview(b"")


class ArenaViews:
    """How the engine sees the protocol processes' arenas: by reference. A tensor whose bytes lie in an arena
    becomes a SharedTensor naming where (the engine never maps the arena: a worker reads it in place)."""

    def close(self) -> None:
        """Nothing to let go: no arena is mapped here."""

    def restore(self, request: InferRequest, refs: ArenaRefs) -> InferRequest:
        if not refs:
            return request
        inputs = list(request.inputs)
        raw: memoryview | SharedTensor | None = request.raw_body
        for index, ref in refs:
            where = Residency(Kind.ARENA, ref.segment, ref.offset, ref.nbytes)
            if index == RAW_BODY:
                raw = SharedTensor("UINT8", (ref.nbytes,), where)
                continue
            tensor = inputs[index]
            inputs[index] = replace(tensor, data=SharedTensor(tensor.datatype, tensor.shape, where))
        return replace(request, inputs=tuple(inputs), raw_body=raw)
