"""OutputArena: a worker's output segment, allocated per batch and given back when the batch's outputs are released."""

# A batch's outputs stay where the worker wrote them until whoever sends the responses is done with them (a
# protocol process encodes straight from them), so several batches' outputs live in the arena at once. Outputs
# that do not fit go to a one-off segment of their own, removed at the same release.

from __future__ import annotations

import mmap
import os
import threading
from dataclasses import dataclass, field

import numpy as np

from geserve.codecs import dtypes
from geserve.free_ranges import give_back, take
from geserve.residency import SHM_DIRECTORY, Kind, Residency, SharedTensor
from geserve.workers.shm import align, create_segment, unlink_quietly


@dataclass(slots=True)
class _Held:
    """What one batch's outputs hold until released: regions of the arena and one-off segments."""

    regions: list[tuple[int, int]] = field(default_factory=list)  # (offset, length)
    segments: list[str] = field(default_factory=list)


class OutputArena:
    """First-fit regions of the segment `name` (made by the worker's owner), held per batch id. Releases may come
    from another thread than allocations (a python model's reader thread), so both take a lock."""

    def __init__(self, name: str) -> None:
        self.name = name
        descriptor = os.open(SHM_DIRECTORY / name, os.O_RDWR)
        try:
            self.mapping = mmap.mmap(descriptor, 0)
        finally:
            os.close(descriptor)
        self.size = len(self.mapping)
        self._free: list[tuple[int, int]] = [(0, self.size)]  # (offset, length), sorted by offset
        self._held: dict[int, _Held] = {}
        self._lock = threading.Lock()

    def allocate(self, batch_id: int, nbytes: int) -> int | None:
        """The offset of `nbytes` held for batch `batch_id`, or None when no free region is large enough."""
        length = max(align(nbytes), 64)
        with self._lock:
            offset = take(self._free, length)
            if offset is not None:
                self._held.setdefault(batch_id, _Held()).regions.append((offset, length))
        return offset

    def one_off(self, batch_id: int, name: str, nbytes: int) -> None:
        """Make segment `name` of `nbytes` for outputs of batch `batch_id` that do not fit: removed at its release."""
        create_segment(name, nbytes).close()
        with self._lock:
            self._held.setdefault(batch_id, _Held()).segments.append(name)

    def release(self, batch_ids: tuple[int, ...]) -> None:
        """The batches' outputs are no longer read: their regions are free again, their one-off segments removed."""
        segments: list[str] = []
        with self._lock:
            for batch_id in batch_ids:
                held = self._held.pop(batch_id, None)
                if held is None:
                    continue
                segments += held.segments
                for offset, length in held.regions:
                    give_back(self._free, offset, length)
        for name in segments:
            unlink_quietly(name)

    @property
    def held(self) -> int:
        """Batches whose outputs are not released yet."""
        with self._lock:
            return len(self._held)

    def release_all(self) -> None:
        """The worker stops: every one-off segment goes (the arena itself is its owner's)."""
        self.release(tuple(self._held))


class InPlaceOutputs:
    """Outputs a backend writes in place, each given a region of the output arena held for the batch while one is
    free; an output that does not fit (or BYTES) gets ordinary memory and is laid out afterwards."""

    def __init__(self, arena: OutputArena, batch_id: int) -> None:
        self._arena = arena
        self._batch_id = batch_id
        self._allocated: dict[str, tuple[np.ndarray, SharedTensor]] = {}

    def allocate(self, name: str, datatype: str, shape: tuple[int, ...]) -> np.ndarray:
        dtype = dtypes.from_wire(datatype).numpy
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        offset = None if datatype == "BYTES" else self._arena.allocate(self._batch_id, nbytes)
        if offset is None:
            return np.empty(shape, dtype)
        array: np.ndarray = np.ndarray(shape, dtype=dtype, buffer=self._arena.mapping, offset=offset)
        where = Residency(Kind.ARENA, self._arena.name, offset, nbytes)
        self._allocated[name] = (array, SharedTensor(datatype, tuple(shape), where))
        return array

    def ref_of(self, name: str, array: np.ndarray) -> SharedTensor | None:
        """Where the output lies in the arena, if the backend returned the very array it was given."""
        allocated = self._allocated.get(name)
        return allocated[1] if allocated is not None and allocated[0] is array else None
