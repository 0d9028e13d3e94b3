"""A worker's shared memory seen from its owner: an input arena per slot, and each process's output arena."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing import shared_memory

from geserve.offload import COPY_BYTES, off_loop
from geserve.residency import MAPPINGS, Kind, Residency, SharedTensor
from geserve.workers.messages import BatchInput
from geserve.workers.runs import RunId
from geserve.workers.shm import TensorLayout, buffer_of, create_segment, discard, unlink_quietly

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ArenaSlot:
    """One batch's hold on a slot of the input arenas, released once the batch is answered; `overflow` is the
    one-off segment its tensors were written to when they did not fit the slot's arena."""

    index: int
    overflow: shared_memory.SharedMemory | None = None


class Arenas:
    """One input arena per slot (a batch the worker may hold at once), which only tensors held in this process's
    memory are written to (sequence controls, warmup samples): every other input is read by the worker where it lies.
    And the output arena the worker process leaves each batch's outputs in until they are released: a fresh one for
    each process of the instance, since readers of a dead process's outputs may still hold them. Every segment's
    name carries `run`."""

    def __init__(self, slots: int, arena_bytes: int, run: RunId) -> None:
        self._count = slots
        self._arena_bytes = arena_bytes
        self._run = run
        self._inputs: list[shared_memory.SharedMemory] = []
        self.output_name = ""
        self._free: asyncio.Queue[int] = asyncio.Queue()

    @property
    def names(self) -> tuple[str, ...]:
        """The input arenas' names."""
        return tuple(segment.name for segment in self._inputs)

    @property
    def available(self) -> bool:
        return bool(self._inputs)

    def create(self) -> None:
        """Create every input arena and the first output arena (raises OSError or UnavailableError when /dev/shm
        cannot hold them)."""
        for index in range(self._count):
            self._inputs.append(create_segment(self._run.segment_name("in"), self._arena_bytes))
            self._free.put_nowait(index)
        self.renew_output()

    def renew_output(self) -> str:
        """A new output arena for a new process of the instance; the last one is removed (its memory stays while
        anyone still maps it). Returns its name."""
        previous = self.output_name
        name = self._run.segment_name("out")
        create_segment(name, self._arena_bytes * self._count).close()
        self.output_name = name
        if previous:
            unlink_quietly(previous)
            MAPPINGS.forget(previous)  # the views still read keep the memory; the cache should not
        return name

    async def place(self, inputs: Mapping[str, Sequence[SharedTensor]]) -> tuple[ArenaSlot, tuple[BatchInput, ...]]:
        """Wait for a free slot, and give each input of the batch as its parts in shared memory: those already there
        as they are, the others written once into the slot's arena (or a one-off segment when they do not fit)."""
        index = await self._free.get()
        slot = ArenaSlot(index)
        try:
            layout = TensorLayout()
            local: list[tuple[int, int]] = []  # (input, part) of the parts to write
            batch: list[tuple[str, str, list[SharedTensor]]] = []
            for position, (name, parts) in enumerate(inputs.items()):
                batch.append((name, parts[0].datatype, list(parts)))
                for part_index, part in enumerate(parts):
                    if not part.in_shared_memory:
                        local.append((position, part_index))
                        layout.add(f"{position}:{part_index}", part.datatype, [part.array])
            if local:
                target, kind = self._inputs[index], Kind.ARENA
                if layout.size > self._arena_bytes:
                    # Reserving a one-off segment's pages takes a while: off the loop.
                    target = await asyncio.to_thread(create_segment, self._run.segment_name("in"), layout.size)
                    kind, slot.overflow = Kind.ONE_OFF, target
                written = await off_loop(layout.size, COPY_BYTES, layout.write, buffer_of(target), target.name)
                for (position, part_index), ref in zip(local, written, strict=True):
                    where = Residency(kind, ref.segment, ref.offset, ref.nbytes)
                    batch[position][2][part_index] = SharedTensor(ref.datatype, ref.shape, where)
            return slot, tuple((name, datatype, tuple(parts)) for name, datatype, parts in batch)
        except BaseException:
            self.release(slot)
            raise

    def release(self, slot: ArenaSlot) -> None:
        """The batch is answered (or failed): its one-off segment goes and its slot is free again."""
        if slot.overflow is not None:
            discard(slot.overflow)
            slot.overflow = None
        self._free.put_nowait(slot.index)

    def unlink(self) -> None:
        """Unlink every arena (also usable from a signal handler's fast path)."""
        for arena in self._inputs:
            discard(arena)
        self._inputs.clear()
        if self.output_name:
            unlink_quietly(self.output_name)
