"""Pipeline steps hand outputs on in shared memory: mapped by the front-end, read in place by the next worker."""

from __future__ import annotations

import asyncio
import gc
import os
from collections.abc import Iterator
from multiprocessing import shared_memory

import numpy as np
import pytest

from geserve.workers.arenas import Arenas
from geserve.workers.handoff import HandoffSegments, MappedOutputs
from geserve.workers.runs import RunId
from geserve.workers.shm import write_tensors

RUN = RunId.current()


@pytest.fixture
def mapped() -> MappedOutputs:
    return MappedOutputs()


@pytest.fixture
def arenas(mapped: MappedOutputs) -> Iterator[Arenas]:
    created = Arenas(1, 1 << 16, RUN, mapped)
    created.create()
    yield created
    created.unlink()


def test_outputs_are_mapped_not_copied_and_the_segment_goes_with_the_last_view(mapped: MappedOutputs) -> None:
    a = np.arange(12, dtype=np.float32).reshape(4, 3)
    labels = np.array([b"x", b"yz"], dtype=np.object_)
    blocks = write_tensors({"A": a, "S": labels}, RUN.segment_name("test"))
    segment = blocks[0].segment
    # Two requests: rows 0..2 and 3 of A; the second also gets S whole.
    results = mapped.map_results(blocks, (((0, 0, 3),), ((0, 3, 1), (1, 0, -1))))
    first, second = results
    assert isinstance(first, dict) and isinstance(second, dict)
    np.testing.assert_array_equal(first["A"], a[:3])
    np.testing.assert_array_equal(second["A"], a[3:])
    assert second["S"].tolist() == [b"x", b"yz"]
    # Each view knows where it lies, so a worker can read it in place.
    ref = mapped.ref_of(second["A"])
    assert ref is not None and ref.segment == segment
    assert (ref.offset - blocks[0].offset, ref.nbytes, ref.shape) == (3 * 3 * 4, 3 * 4, (1, 3))
    assert mapped.ref_of(a) is None and mapped.ref_of(second["S"]) is None
    assert os.path.exists(f"/dev/shm/{segment}")
    del first, second, results, ref
    gc.collect()
    assert not os.path.exists(f"/dev/shm/{segment}")


def test_a_mapped_input_is_passed_to_the_next_worker_by_reference(arenas: Arenas, mapped: MappedOutputs) -> None:
    blocks = write_tensors({"OUT": np.arange(6, dtype=np.int32).reshape(2, 3)}, RUN.segment_name("test"))
    (outputs,) = mapped.map_results(blocks, (((0, 0, -1),),))
    assert isinstance(outputs, dict)
    fresh = np.ones((2, 2), dtype=np.float32)
    slot = asyncio.run(arenas.write_inputs({"IN": [outputs["OUT"]], "OTHER": [fresh]}))
    by_name = {ref.name: ref for ref in slot.inputs}
    assert by_name["IN"].segment == blocks[0].segment and by_name["IN"].offset == blocks[0].offset
    assert by_name["OTHER"].segment in arenas.names  # an ordinary input is written into the arena
    arenas.release(slot, collected=True)
    del outputs
    gc.collect()
    assert not os.path.exists(f"/dev/shm/{blocks[0].segment}")


def test_handoff_segments_are_reused_once_their_views_are_gone(mapped: MappedOutputs) -> None:
    pool = HandoffSegments(1 << 16, RUN, mapped)
    first = pool.acquire()
    assert first.startswith(RUN.prefix)
    ref = write_tensors({"A": np.arange(4, dtype=np.float32)}, RUN.segment_name("test"))[0]
    # The worker wrote into `first` (as the test writes into a one-off segment, then copies it there).
    segment = shared_memory.SharedMemory(name=first)
    try:
        segment.buf[: ref.nbytes] = np.arange(4, dtype=np.float32).tobytes()
    finally:
        segment.close()
    (outputs,) = pool.map_results(first, (ref._replace(segment=first, offset=0),), (((0, 0, -1),),))
    assert isinstance(outputs, dict) and outputs["A"].tolist() == [0.0, 1.0, 2.0, 3.0]
    second = pool.acquire()
    assert second != first  # still in use
    pool.release(second)
    del outputs
    gc.collect()
    assert pool.acquire() == first  # free again, and not recreated
    pool.close()
    pool.release(first)
    gc.collect()
    assert not os.path.exists(f"/dev/shm/{first}") and not os.path.exists(f"/dev/shm/{second}")
    os.unlink(f"/dev/shm/{ref.segment}")


def test_a_mapping_is_known_only_to_the_outputs_object_that_made_it(arenas: Arenas, mapped: MappedOutputs) -> None:
    """Each server's workers share one MappedOutputs; another one's views are ordinary arrays to them."""
    other = MappedOutputs()
    blocks = write_tensors({"OUT": np.arange(6, dtype=np.int32).reshape(2, 3)}, RUN.segment_name("test"))
    (outputs,) = other.map_results(blocks, (((0, 0, -1),),))
    assert isinstance(outputs, dict)
    assert other.ref_of(outputs["OUT"]) is not None and mapped.ref_of(outputs["OUT"]) is None
    slot = asyncio.run(arenas.write_inputs({"IN": [outputs["OUT"]]}))
    assert slot.inputs[0].segment in arenas.names  # copied into the arena, not passed by reference
    arenas.release(slot, collected=True)
    del outputs
    gc.collect()
    assert not os.path.exists(f"/dev/shm/{blocks[0].segment}")
