"""RequestArena: the shared segment a protocol process places its requests' inputs in, for workers to read there."""

# HTTP bodies are read into it from the socket; other inputs are copied there once. The engine never maps it.

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import logging
import mmap
import os
import threading
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np

from geserve.errors import UnavailableError
from geserve.free_ranges import give_back, take
from geserve.residency import SHM_DIRECTORY, Kind, Residency
from geserve.settings import DEFAULT_REQUEST_ARENA_BYTES

logger = logging.getLogger(__name__)

_ALIGNMENT = 64


class RequestArena:
    """A segment of `size` bytes with a first-fit allocator. A block is free again once no view of it is left
    (the request is answered and dropped); a full arena is not an error: the caller places the bytes elsewhere."""

    def __init__(self, name: str, size: int = DEFAULT_REQUEST_ARENA_BYTES) -> None:
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
            offset = take(self._free, length)
        if offset is None:
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
            give_back(self._free, *self._returned.popleft())

    def where(self, data: memoryview | np.ndarray) -> Residency | None:
        """Where `data` lies in this arena; None when it is memory of its own."""
        if isinstance(data, memoryview):
            if not data.c_contiguous:
                return None
            data = np.frombuffer(data.cast("B") if data.format != "B" or data.ndim != 1 else data, dtype=np.uint8)
        if data.nbytes == 0 or not data.flags.c_contiguous:
            return None
        view = data
        offset = int(view.__array_interface__["data"][0]) - self._start
        if offset < 0 or offset + view.nbytes > self._size:
            return None
        return Residency(Kind.ARENA, self.name, offset, view.nbytes)


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


def request_arena(name: str, size: int = DEFAULT_REQUEST_ARENA_BYTES) -> RequestArena | None:
    """The request arena `name`, or None, with the reason logged, where /dev/shm cannot hold it: inputs then go to
    segments of their own, one per input."""
    try:
        return RequestArena(name, size)
    except (UnavailableError, OSError) as error:
        message = error.message if isinstance(error, UnavailableError) else str(error)
        logger.warning("no request arena (%s): every input gets a shared-memory segment of its own", message)
        return None


def body_allocator(arena: RequestArena) -> Callable[[int], memoryview]:
    """Where an HTTP request's body is read to from its socket: a block of the arena, or the heap when it is full."""

    def allocate(size: int) -> memoryview:
        block = arena.allocate(size)
        return memoryview(bytearray(size)) if block is None else block.data

    return allocate
