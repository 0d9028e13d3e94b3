"""A worker's shared memory seen from the front-end: arena pairs per slot, one-off overflow segments."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np

from geserve.backends.base import RequestResult
from geserve.codecs import dtypes
from geserve.offload import COPY_BYTES, off_loop
from geserve.workers.handoff import MappedOutputs
from geserve.workers.messages import PlacedResult, request_outputs
from geserve.workers.runs import RunId
from geserve.workers.shm import (
    TensorLayout,
    TensorRef,
    attach_segment,
    buffer_of,
    create_segment,
    discard,
    read_tensor,
    unlink_quietly,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ArenaSlot:
    """One batch's hold on a slot of the arenas: where its inputs were written and where its outputs go; released
    once the batch is answered."""

    index: int
    inputs: tuple[TensorRef, ...]
    output_arena: str
    output_overflow: str  # the segment the worker creates when the outputs do not fit the arena
    input_overflow: shared_memory.SharedMemory | None


class Arenas:
    """One input and one output arena per slot (a batch the worker may hold at once). A batch's inputs
    are written once, contiguously, into a free slot's input arena (or a one-off segment when they do
    not fit); its outputs are copied out of the output arena once, after which the slot is free. Every segment's
    name carries `run`; inputs that are a previous pipeline step's outputs, still mapped (`mapped`), are passed
    on in place."""

    def __init__(self, slots: int, arena_bytes: int, run: RunId, mapped: MappedOutputs) -> None:
        self._count = slots
        self._arena_bytes = arena_bytes
        self._run = run
        self._mapped = mapped
        self._segments: dict[str, shared_memory.SharedMemory] = {}
        self._slots: list[tuple[str, str]] = []
        self._free: asyncio.Queue[int] = asyncio.Queue()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._segments)

    def create(self) -> None:
        """Create every arena (raises OSError or UnavailableError when /dev/shm cannot hold them)."""
        for index in range(self._count):
            pair = (self._run.segment_name("in"), self._run.segment_name("out"))
            for name in pair:
                self._segments[name] = create_segment(name, self._arena_bytes)
            self._slots.append(pair)
            self._free.put_nowait(index)

    async def write_inputs(self, inputs: Mapping[str, Sequence[np.ndarray]]) -> ArenaSlot:
        """Wait for a free slot and write the batch's inputs (each given as the requests' row blocks)."""
        index = await self._free.get()
        try:
            input_name, output_name = self._slots[index]
            layout = TensorLayout()
            passed: list[TensorRef] = []  # a previous step's outputs, still in shared memory: read in place
            for name, parts in inputs.items():
                mapped = self._mapped.ref_of(parts[0]) if len(parts) == 1 else None
                if mapped is not None:
                    logger.debug("input '%s' passed on in place: %d bytes of %s", name, mapped.nbytes, mapped.segment)
                    passed.append(mapped._replace(name=name))
                else:
                    layout.add(name, dtypes.from_numpy(parts[0].dtype).wire, parts)
            overflow = None
            if layout.size > self._arena_bytes:
                # A batch too large for the arena; reserving its pages takes a while, so off the loop.
                overflow = await asyncio.to_thread(create_segment, self._run.segment_name("in"), layout.size)
            target = overflow if overflow is not None else self._segments[input_name]
            segment = overflow.name if overflow is not None else input_name
            slot = ArenaSlot(index, (), output_name, self._run.segment_name("out"), overflow)
            slot.inputs = await off_loop(layout.size, COPY_BYTES, layout.write, buffer_of(target), segment)
            slot.inputs += tuple(passed)
            return slot
        except BaseException:
            self._free.put_nowait(index)
            raise

    async def collect(
        self, blocks: tuple[TensorRef, ...], placed: tuple[PlacedResult, ...]
    ) -> tuple[RequestResult, ...]:
        """Each request's outputs: every block copied out of shared memory once (the arena is reused by the
        next batch), each request getting views of its rows; an overflow segment is unlinked after reading."""
        arrays = await off_loop(sum(block.nbytes for block in blocks), COPY_BYTES, self.read, blocks)
        return request_outputs(arrays, blocks, placed)

    def read(self, refs: Sequence[TensorRef]) -> list[np.ndarray]:
        """Copy tensors out of shared memory (views are kept only for BYTES, which decoding already copied)."""
        arrays: list[np.ndarray] = []
        overflow: shared_memory.SharedMemory | None = None
        try:
            for ref in refs:
                segment = self._segments.get(ref.segment)
                if segment is None:
                    overflow = overflow or attach_segment(ref.segment)
                    segment = overflow
                view = read_tensor(buffer_of(segment), ref)
                arrays.append(view if ref.datatype == "BYTES" else view.copy())
                del view
            return arrays
        finally:
            if overflow is not None:
                discard(overflow)

    def release(self, slot: ArenaSlot, collected: bool) -> None:
        """The batch is answered (or failed): its overflow segments go and its slot is free again. Once its
        outputs were collected, an output overflow segment is already gone (`read` unlinks it)."""
        if slot.input_overflow is not None:
            discard(slot.input_overflow)
        if not collected:
            unlink_quietly(slot.output_overflow)  # left behind when the worker died mid-write
        self._free.put_nowait(slot.index)

    def unlink(self) -> None:
        """Unlink every arena (also usable from a signal handler's fast path)."""
        for arena in self._segments.values():
            discard(arena)
        self._segments.clear()

    @property
    def available(self) -> bool:
        return bool(self._segments)
