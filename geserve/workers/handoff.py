"""Batch outputs left in shared memory for a pipeline's next step: mapped, not copied, and passed on by reference."""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from collections.abc import Callable, Sequence

import numpy as np

from geserve.backends.base import RequestResult
from geserve.codecs import bytes as bytes_codec
from geserve.codecs import dtypes
from geserve.workers.messages import PlacedResult, request_outputs
from geserve.workers.runs import RunId
from geserve.workers.shm import SHM_DIRECTORY, TensorRef, create_segment, unlink_quietly

# Free handoff segments a worker keeps for its next batches; more are unlinked when they come back.
_IDLE_SEGMENTS = 4


class MappedOutputs:
    """The handoff mappings in use, so that a pipeline's next step can be given a view of one by reference
    (`ref_of`). One per server, made by whoever makes its workers (the InstancePools) and shared by every
    worker's HandoffSegments, which map outputs, and Arenas, which pass them on."""

    def __init__(self) -> None:
        # By id of the whole-segment array (arrays are not hashable): its segment, and a weak reference that
        # tells the array from a later one given the same id.
        self._mapped: dict[int, tuple[str, weakref.ref[np.ndarray]]] = {}

    def map_results(self, blocks: Sequence[TensorRef], placed: Sequence[PlacedResult]) -> tuple[RequestResult, ...]:
        """`HandoffSegments.map_results` for one-off segments, which are unlinked once no view of them is left."""
        mapped = {
            name: self.track(np.frombuffer(_map(name), dtype=np.uint8), name, unlink_quietly)
            for name in dict.fromkeys(block.segment for block in blocks)
        }
        return _results(mapped, blocks, placed)

    def track(self, whole: np.ndarray, name: str, done: Callable[[str], None]) -> np.ndarray:
        """Track a mapping of segment `name`: `done(name)` once no view of it is left."""
        key = id(whole)
        self._mapped[key] = (name, weakref.ref(whole))
        weakref.finalize(whole, self._finished, key, name, done)
        return whole

    def _finished(self, key: int, name: str, done: Callable[[str], None]) -> None:
        self._mapped.pop(key, None)
        done(name)

    def ref_of(self, array: np.ndarray) -> TensorRef | None:
        """Where a view made by `map_results` lies in shared memory, so that a worker can read it in place;
        None for any other array (or one that is not contiguous)."""
        base = array.base
        if not isinstance(base, np.ndarray) or array.dtype.kind == "O" or not array.flags.c_contiguous:
            return None
        entry = self._mapped.get(id(base))
        if entry is None or entry[1]() is not base:
            return None
        offset = array.__array_interface__["data"][0] - base.__array_interface__["data"][0]
        return TensorRef("", dtypes.from_numpy(array.dtype).wire, tuple(array.shape), offset, array.nbytes, entry[0])


class HandoffSegments:
    """The segments one worker writes a pipeline step's outputs to. Each is created (its pages reserved) and
    mapped once, then reused: it is free again once no view of what it holds is left. Their names carry `run`."""

    def __init__(self, size: int, run: RunId, mapped: MappedOutputs) -> None:
        self._size = size
        self._run = run
        self._tracked = mapped
        self._idle: list[str] = []
        self._mappings: dict[str, mmap.mmap] = {}
        self._lock = threading.Lock()  # views die wherever the garbage collector runs
        self._closed = False

    def acquire(self) -> str:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        name = self._run.segment_name("handoff")
        create_segment(name, self._size).close()
        self._mappings[name] = _map(name)
        return name

    def release(self, name: str) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < _IDLE_SEGMENTS:
                self._idle.append(name)
                return
            self._mappings.pop(name, None)  # the mapping goes with its last view
        unlink_quietly(name)

    def close(self) -> None:
        """The worker stops: free segments go now, the others once their views are gone."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            for name in idle:
                self._mappings.pop(name, None)
        for name in idle:
            unlink_quietly(name)

    def map_results(
        self, name: str, blocks: Sequence[TensorRef], placed: Sequence[PlacedResult]
    ) -> tuple[RequestResult, ...]:
        """Each request's outputs as views of segment `name` (or of the one-off segment the worker wrote
        outputs too large for it to): nothing is copied (BYTES are decoded)."""
        if not blocks or any(block.segment != name for block in blocks):
            self.release(name)
            return self._tracked.map_results(blocks, placed)
        whole = np.frombuffer(self._mappings[name], dtype=np.uint8)
        return _results({name: self._tracked.track(whole, name, self.release)}, blocks, placed)


def _map(name: str) -> mmap.mmap:
    descriptor = os.open(SHM_DIRECTORY / name, os.O_RDWR)
    try:
        return mmap.mmap(descriptor, 0)
    finally:
        os.close(descriptor)


def _results(
    mapped: dict[str, np.ndarray], blocks: Sequence[TensorRef], placed: Sequence[PlacedResult]
) -> tuple[RequestResult, ...]:
    arrays = []
    for ref in blocks:
        data = mapped[ref.segment][ref.offset : ref.offset + ref.nbytes]
        if ref.datatype == "BYTES":
            arrays.append(bytes_codec.deserialize(data.tobytes()).reshape(ref.shape))
        else:
            arrays.append(data.view(dtypes.from_wire(ref.datatype).numpy).reshape(ref.shape))
    del mapped
    return request_outputs(arrays, blocks, placed)
