"""The request arena: its allocator, where views lie in it, requests as they cross to the engine and back."""

from __future__ import annotations

import gc
import itertools
import mmap
import pickle
from collections.abc import Iterator

import numpy as np
import pytest

from geserve.multiprocess.arena import (
    PLACE_MIN_BYTES,
    RAW_BODY,
    ArenaRef,
    ArenaViews,
    RequestArena,
    to_engine,
)
from geserve.types import InferInput, InferRequest
from geserve.workers.handoff import MappedOutputs
from geserve.workers.runs import RunId
from geserve.workers.shm import SHM_DIRECTORY

RUN = RunId.current()
SIZE = 256 << 10
BLOCK = 64 << 10  # four of them fill the arena


@pytest.fixture
def arena() -> Iterator[RequestArena]:
    made = RequestArena(RUN.segment_name("requests0"), SIZE)
    yield made
    made.close()
    assert not (SHM_DIRECTORY / made.name).exists()


def _segment_bytes(name: str, offset: int, nbytes: int) -> bytes:
    """What the segment holds there, read through a mapping of its own (as the engine reads it)."""
    with open(SHM_DIRECTORY / name, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapping:
        return mapping[offset : offset + nbytes]


def _address(data: np.ndarray | memoryview) -> int:
    return int(np.frombuffer(data, dtype=np.uint8).__array_interface__["data"][0])


# -- the allocator -------------------------------------------------------------------------


def test_the_segment_is_named_for_the_run_and_removed_on_close() -> None:
    made = RequestArena(RUN.segment_name("requests0"), SIZE)
    assert made.name.startswith(RUN.prefix) and made.name.endswith("_requests0")
    assert (SHM_DIRECTORY / made.name).stat().st_size == SIZE
    made.close()
    assert not (SHM_DIRECTORY / made.name).exists()
    made.close()  # twice is harmless


def test_blocks_are_disjoint_aligned_and_of_the_size_asked(arena: RequestArena) -> None:
    blocks = [arena.allocate(size) for size in (1, 100, 4096, 5000)]
    assert all(block is not None for block in blocks)
    spans = []
    for block, size in zip(blocks, (1, 100, 4096, 5000), strict=True):
        assert block is not None and block.dtype == np.uint8 and block.nbytes == size
        ref = arena.ref_of(block.data)
        assert ref is not None and ref.offset % 64 == 0
        spans.append((ref.offset, ref.offset + size))
    spans.sort()
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))
    # What one block holds does not reach another.
    for index, block in enumerate(blocks):
        assert block is not None
        block[:] = index + 1
    for index, block in enumerate(blocks):
        assert block is not None and np.all(block == index + 1)


def test_a_full_arena_answers_none_and_a_freed_block_is_given_again(arena: RequestArena) -> None:
    blocks = [arena.allocate(BLOCK) for _ in range(4)]
    assert all(block is not None for block in blocks)
    assert arena.allocate(1) is None
    assert arena.allocate(SIZE + 1) is None
    held = blocks[2]
    assert held is not None
    offset = _address(held)
    del held
    blocks[2] = None
    gc.collect()
    again = arena.allocate(BLOCK)
    assert again is not None and _address(again) == offset
    assert arena.allocate(1) is None


def test_a_memoryview_of_a_block_keeps_it_until_the_view_dies(arena: RequestArena) -> None:
    # What an HTTP body is given: block.data, sliced per input.
    block = arena.allocate(SIZE)
    assert block is not None
    body = block.data[100:200]
    del block
    gc.collect()
    assert arena.allocate(1) is None  # the body still lies there
    del body
    gc.collect()
    assert arena.allocate(SIZE) is not None


def test_a_numpy_view_of_a_block_keeps_it_too(arena: RequestArena) -> None:
    block = arena.allocate(SIZE)
    assert block is not None
    part = block[10:20]
    del block
    gc.collect()
    assert arena.allocate(1) is None
    del part


@pytest.mark.parametrize("order", [(0, 1, 2, 3), (3, 2, 1, 0), (1, 3, 0, 2), (2, 0, 3, 1)])
def test_freed_neighbours_merge_so_the_whole_arena_is_one_block_again(
    arena: RequestArena, order: tuple[int, ...]
) -> None:
    for _ in range(3):  # and again after a reuse
        blocks: list[np.ndarray | None] = [arena.allocate(BLOCK) for _ in range(4)]
        assert all(block is not None for block in blocks)
        for index in order:
            blocks[index] = None  # freed at once: its last reference went
        whole = arena.allocate(SIZE)
        assert whole is not None, f"freed in order {order}, the arena is still in pieces: {arena._free}"
        del whole


def test_two_freed_neighbours_between_held_blocks_make_one_block(arena: RequestArena) -> None:
    blocks: list[np.ndarray | None] = [arena.allocate(BLOCK) for _ in range(4)]
    blocks[2] = None
    blocks[1] = None
    gc.collect()
    assert arena.allocate(2 * BLOCK + 1) is None
    merged = arena.allocate(2 * BLOCK)
    assert merged is not None
    assert blocks[0] is not None and _address(merged) == _address(blocks[0]) + BLOCK
    assert arena.allocate(1) is None


# -- where views lie -----------------------------------------------------------------------


def test_ref_of_finds_views_inside_and_nothing_outside(arena: RequestArena) -> None:
    first = arena.allocate(1000)
    second = arena.allocate(BLOCK)
    assert first is not None and second is not None
    base = arena.ref_of(first.data)
    assert base is not None and base == ArenaRef(arena.name, base.offset, 1000)
    inner = arena.ref_of(second.data[10:30])
    outer = arena.ref_of(second.data)
    assert outer is not None and inner == ArenaRef(arena.name, outer.offset + 10, 20)
    assert arena.ref_of(memoryview(bytearray(BLOCK))) is None
    assert arena.ref_of(memoryview(np.zeros(BLOCK, np.uint8))) is None
    assert arena.ref_of(second.data[5:5]) is None  # empty
    assert arena.ref_of(second.data[::2]) is None  # not contiguous
    # Typed views count in bytes.
    floats = second.view(np.float32)
    typed = arena.ref_of(memoryview(floats))
    assert typed is not None and typed == ArenaRef(arena.name, outer.offset, BLOCK)


def test_ref_of_another_arena_is_none(arena: RequestArena) -> None:
    other = RequestArena(RUN.segment_name("requests0"), SIZE)
    try:
        block = other.allocate(100)
        assert block is not None
        mine = arena.allocate(100)
        assert mine is not None
        # Whichever of the two lies higher in the address space, neither claims the other's memory.
        assert arena.ref_of(block.data) is None and other.ref_of(block.data) is not None
        assert other.ref_of(mine.data) is None and arena.ref_of(mine.data) is not None
        del block, mine
    finally:
        other.close()


def test_place_copies_the_bytes_into_a_block_the_caller_keeps(arena: RequestArena) -> None:
    data = np.random.default_rng(3).integers(0, 256, BLOCK + 5, dtype=np.uint8).tobytes()
    placed = arena.place(memoryview(data))
    assert placed is not None
    ref, block = placed
    assert ref.segment == arena.name and ref.nbytes == len(data) and ref.offset % 64 == 0
    assert _segment_bytes(arena.name, ref.offset, ref.nbytes) == data
    assert arena.ref_of(block.data) == ref
    # The block stays taken while the caller keeps it.
    assert arena.place(memoryview(bytes(SIZE - BLOCK))) is None
    del block, placed
    gc.collect()
    assert arena.place(memoryview(bytes(SIZE))) is not None


# -- to the engine and back ----------------------------------------------------------------

LARGE = PLACE_MIN_BYTES  # the smallest input that is placed


def _floats(count: int, start: float = 0.0) -> np.ndarray:
    return np.arange(start, start + count, dtype=np.float32)


def test_to_engine_places_large_byte_inputs_and_leaves_the_rest(arena: RequestArena) -> None:
    large = _floats(LARGE // 4)
    small = _floats(LARGE // 4 - 1)
    typed = _floats(LARGE)  # a numpy input (JSON, typed protobuf): its own array, sent as it is
    inputs = (
        InferInput("LARGE", "FP32", large.shape, memoryview(large.tobytes())),
        InferInput("SMALL", "FP32", small.shape, memoryview(small.tobytes())),
        InferInput("TYPED", "FP32", typed.shape, typed),
    )
    request = InferRequest("echo", "1", inputs, id="r1", parameters={"priority": 2})
    outgoing, refs, keep = to_engine(request, arena)
    [(index, ref)] = refs
    assert index == 0 and ref.segment == arena.name and ref.nbytes == large.nbytes
    assert _segment_bytes(arena.name, ref.offset, ref.nbytes) == large.tobytes()
    assert outgoing.inputs[0].data.nbytes == 0  # the bytes went to the arena, not into the message
    assert outgoing.inputs[1] is inputs[1] and outgoing.inputs[2] is inputs[2]
    assert (outgoing.model_name, outgoing.model_version, outgoing.id) == ("echo", "1", "r1")
    assert outgoing.parameters == {"priority": 2} and outgoing.raw_body is None
    # Kept alive until the engine answers: the request, and the block its input was placed in.
    assert keep[0] is request and len(keep) == 2 and arena.ref_of(keep[1].data) == ref
    # The large input's bytes do not travel in the message.
    assert len(pickle.dumps(outgoing, protocol=5)) < len(pickle.dumps(request, protocol=5)) - large.nbytes + 1024


def test_to_engine_sends_an_input_read_into_the_arena_by_where_it_lies(arena: RequestArena) -> None:
    body = arena.allocate(2 * LARGE)
    assert body is not None
    body[:] = np.arange(2 * LARGE, dtype=np.uint8) % 251
    first, second = body.data[:LARGE], body.data[LARGE:]
    inputs = (InferInput("A", "UINT8", (LARGE,), first), InferInput("B", "UINT8", (LARGE,), second))
    request = InferRequest("echo", "", inputs)
    outgoing, refs, keep = to_engine(request, arena)
    assert dict(refs) == {0: arena.ref_of(first), 1: arena.ref_of(second)}
    assert keep == [request]  # nothing copied, nothing more to keep
    assert all(tensor.data.nbytes == 0 for tensor in outgoing.inputs)


def test_to_engine_places_a_large_raw_body(arena: RequestArena) -> None:
    raw = _floats(LARGE).tobytes()
    request = InferRequest("echo", "", (), raw_body=memoryview(raw))
    outgoing, refs, keep = to_engine(request, arena)
    [(index, ref)] = refs
    assert index == RAW_BODY and ref.nbytes == len(raw)
    assert _segment_bytes(arena.name, ref.offset, ref.nbytes) == raw
    assert outgoing.raw_body is not None and outgoing.raw_body.nbytes == 0 and len(keep) == 2
    small = InferRequest("echo", "", (), raw_body=memoryview(raw[: LARGE - 1]))
    assert to_engine(small, arena) == (small, (), [small])


def test_to_engine_with_a_full_arena_sends_the_bytes(arena: RequestArena) -> None:
    filler = arena.allocate(SIZE)
    assert filler is not None
    data = memoryview(_floats(LARGE).tobytes())
    request = InferRequest("echo", "", (InferInput("INPUT0", "FP32", (LARGE,), data),))
    outgoing, refs, keep = to_engine(request, arena)
    assert outgoing is request and refs == () and keep == [request]
    del filler


Crossed = tuple[InferRequest, tuple[tuple[int, ArenaRef], ...]]


def _crossed(request: InferRequest, arena: RequestArena, keep: list[object]) -> Crossed:
    """The request as the engine receives it: through to_engine, then pickled as the channel pickles it; what
    must stay alive until the engine answers goes to `keep`."""
    outgoing, refs, kept = to_engine(request, arena)
    keep.extend(kept)
    crossed: Crossed = pickle.loads(pickle.dumps((outgoing, refs), protocol=5))
    return crossed


def _fp32_request(values: np.ndarray) -> InferRequest:
    return InferRequest("m", "", (InferInput("X", "FP32", values.shape, memoryview(values.tobytes())),))


def test_restore_gives_typed_arrays_that_view_the_mapping(arena: RequestArena) -> None:
    mapped = MappedOutputs()
    views = ArenaViews(mapped)
    values = _floats(LARGE, 0.5).reshape(8, -1)
    body = arena.allocate(values.nbytes)
    assert body is not None
    body[:] = np.frombuffer(values.tobytes(), np.uint8)
    ints = np.arange(LARGE // 4, dtype=np.int32).reshape(2, -1)
    request = InferRequest(
        "echo",
        "",
        (
            InferInput("F", "FP32", values.shape, body.data),
            InferInput("I", "INT32", ints.shape, memoryview(ints.tobytes())),
        ),
    )
    keep: list[object] = []
    restored = views.restore(*_crossed(request, arena, keep))
    floats, integers = restored.inputs[0].data, restored.inputs[1].data
    assert isinstance(floats, np.ndarray) and floats.dtype == np.float32 and floats.shape == values.shape
    assert isinstance(integers, np.ndarray) and integers.dtype == np.int32 and integers.shape == ints.shape
    np.testing.assert_array_equal(floats, values)
    np.testing.assert_array_equal(integers, ints)
    # A view of the segment, not a copy: what the protocol process writes there shows.
    body[:4] = np.frombuffer(np.float32(-7.0).tobytes(), np.uint8)
    assert floats[0, 0] == -7.0
    # Tracked, so that a worker is given where it lies instead of its bytes.
    where = mapped.ref_of(floats)
    source = arena.ref_of(body.data)
    assert where is not None and source is not None
    assert (where.segment, where.offset, where.nbytes) == (arena.name, source.offset, values.nbytes)
    assert (where.datatype, where.shape) == ("FP32", values.shape)
    other = mapped.ref_of(integers)
    assert other is not None and other.segment == arena.name and other.datatype == "INT32"
    assert mapped.ref_of(values) is None
    views.close()


@pytest.mark.parametrize(
    ("datatype", "shape"),
    [
        ("BYTES", (1,)),  # variable size: the bytes, for the codec
        ("FP32", (LARGE // 4 + 1,)),  # a byte count that does not match the shape: validation says so
        ("FP32", (LARGE // 8,)),
        ("NOPE", (LARGE,)),  # an unknown datatype
    ],
)
def test_restore_gives_bytes_where_an_array_would_be_wrong(
    arena: RequestArena, datatype: str, shape: tuple[int, ...]
) -> None:
    data = np.random.default_rng(5).integers(0, 256, LARGE, dtype=np.uint8).tobytes()
    request = InferRequest("echo", "", (InferInput("X", datatype, shape, memoryview(data)),))
    keep: list[object] = []
    restored = ArenaViews(MappedOutputs()).restore(*_crossed(request, arena, keep))
    tensor = restored.inputs[0]
    assert isinstance(tensor.data, memoryview) and bytes(tensor.data) == data
    assert (tensor.name, tensor.datatype, tensor.shape) == ("X", datatype, shape)


def test_restore_gives_the_raw_body_and_leaves_requests_without_refs_alone(arena: RequestArena) -> None:
    views = ArenaViews(MappedOutputs())
    raw = _floats(LARGE).tobytes()
    keep: list[object] = []
    restored = views.restore(*_crossed(InferRequest("echo", "", (), raw_body=memoryview(raw)), arena, keep))
    assert isinstance(restored.raw_body, memoryview) and bytes(restored.raw_body) == raw
    plain = InferRequest("echo", "", (InferInput("X", "FP32", (2,), _floats(2)),))
    assert views.restore(plain, ()) is plain


def test_restored_arrays_outlive_the_views_object_and_the_segment_name(arena: RequestArena) -> None:
    views = ArenaViews(MappedOutputs())
    values = _floats(LARGE)
    keep: list[object] = []
    restored = views.restore(*_crossed(_fp32_request(values), arena, keep))
    views.close()
    arena.close()  # unlinked: the engine's mapping stays valid while its views live
    np.testing.assert_array_equal(restored.inputs[0].data, values)


def test_one_mapping_per_arena_segment(arena: RequestArena) -> None:
    views = ArenaViews(MappedOutputs())
    keep: list[object] = []
    first = views.restore(*_crossed(_fp32_request(_floats(LARGE)), arena, keep))
    second = views.restore(*_crossed(_fp32_request(_floats(LARGE, 3.0)), arena, keep))
    left, right = first.inputs[0].data, second.inputs[0].data
    assert isinstance(left, np.ndarray) and isinstance(right, np.ndarray)
    assert left.base is right.base  # the same mapping of the segment
    np.testing.assert_array_equal(left, _floats(LARGE))
    np.testing.assert_array_equal(right, _floats(LARGE, 3.0))
    views.close()
