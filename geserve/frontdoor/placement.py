"""Placing a request's inputs in shared memory for a worker to read: the request arena, or a segment of its own."""

from __future__ import annotations

import numpy as np

from geserve.codecs import bytes as bytes_codec
from geserve.frontdoor.arena import RequestArena
from geserve.residency import Kind, Lease, Residency, SharedTensor
from geserve.workers.runs import RunId
from geserve.workers.shm import buffer_of, create_segment, unlink_quietly


class Placement:
    """Puts tensors where a worker can read them. Bytes already in the request arena (an HTTP body read there) stay
    where they are; others are copied into a block of it once, or, when the arena is full, into a segment of their
    own. Each tensor holds what keeps its bytes (the block, the segment) for as long as it lives, so whoever holds the
    request holds its inputs."""

    def __init__(self, arena: RequestArena | None, run: RunId) -> None:
        self._arena = arena
        self._run = run

    def place(self, datatype: str, shape: tuple[int, ...], data: memoryview | np.ndarray) -> SharedTensor:
        """The tensor `data` holds (raw little-endian bytes, framed BYTES elements, or an array) in shared memory."""
        if isinstance(data, np.ndarray):
            raw: memoryview = memoryview(bytes_codec.wire_bytes(datatype, data)).cast("B")
        else:
            raw = _flat(data)
            if self._arena is not None:
                where = self._arena.where(raw)
                if where is not None:
                    return SharedTensor(datatype, shape, where, lease=raw)  # the view keeps the body's block
        if not raw.nbytes and 0 in shape:  # no elements: nothing to share
            return SharedTensor.zeros(datatype, shape)
        if self._arena is not None:
            block = self._arena.allocate(raw.nbytes)
            if block is not None:
                block[:] = np.frombuffer(raw, dtype=np.uint8)
                where = self._arena.where(block)
                if where is not None:
                    return SharedTensor(datatype, shape, where, lease=block)
        return self._one_off(datatype, shape, raw)

    def _one_off(self, datatype: str, shape: tuple[int, ...], raw: memoryview) -> SharedTensor:
        """A segment for this tensor alone, removed once nobody holds the tensor."""
        name = self._run.segment_name("in")
        segment = create_segment(name, raw.nbytes)
        try:
            buffer_of(segment)[: raw.nbytes] = raw
        except BaseException:
            unlink_quietly(name)
            raise
        finally:
            segment.close()
        where = Residency(Kind.ONE_OFF, name, 0, raw.nbytes)
        return SharedTensor(datatype, shape, where, lease=Lease(name, _unlink))


def _unlink(name: object) -> None:
    assert isinstance(name, str)
    unlink_quietly(name)


def _flat(data: memoryview) -> memoryview:
    """`data` as one flat run of bytes (a copy only where it is not contiguous)."""
    if not data.c_contiguous:
        return memoryview(data.tobytes())
    return data if data.format == "B" and data.ndim == 1 else data.cast("B")
