"""The request arena: its allocator, where views lie in it, and placing inputs in it or, when it is full, elsewhere."""

from __future__ import annotations

import errno
import gc
import itertools
import logging
import mmap
import os
import pickle
from collections.abc import Iterator

import numpy as np
import pytest

from geserve.codecs import bytes as bytes_codec
from geserve.errors import UnavailableError
from geserve.frontdoor.arena import RequestArena, body_allocator, request_arena
from geserve.frontdoor.placement import Placement
from geserve.residency import MAPPINGS, SHM_DIRECTORY, Kind, Residency
from geserve.workers.runs import RunId

RUN = RunId.current()
SIZE = 256 << 10
BLOCK = 64 << 10  # four of them fill the arena


def _run_segments() -> set[str]:
    return {entry.name for entry in SHM_DIRECTORY.iterdir() if entry.name.startswith(RUN.prefix)}


@pytest.fixture(autouse=True)
def nothing_left_behind() -> Iterator[None]:
    """Every segment a test makes (an arena, an input's segment of its own) is gone by its end; the mappings its
    tensors were read through are let go."""
    segments, mapped = _run_segments(), set(MAPPINGS.names())
    yield
    gc.collect()
    for name in set(MAPPINGS.names()) - mapped:
        MAPPINGS.forget(name)
    left = _run_segments() - segments
    for name in left:
        (SHM_DIRECTORY / name).unlink(missing_ok=True)
    assert not left, f"segments left behind: {sorted(left)}"


@pytest.fixture
def arena() -> Iterator[RequestArena]:
    made = RequestArena(RUN.segment_name("requests0"), SIZE)
    yield made
    made.close()
    assert not (SHM_DIRECTORY / made.name).exists()


def _segment_bytes(name: str, offset: int, nbytes: int) -> bytes:
    """What the segment holds there, read through a mapping of its own (as a worker reads it)."""
    with open(SHM_DIRECTORY / name, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapping:
        return mapping[offset : offset + nbytes]


def _address(data: np.ndarray | memoryview) -> int:
    return int(np.frombuffer(data, dtype=np.uint8).__array_interface__["data"][0])


def _random_bytes(count: int, seed: int = 3) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, count, dtype=np.uint8).tobytes()


# -- the allocator -------------------------------------------------------------------------


def test_the_segment_is_named_for_the_run_and_removed_on_close() -> None:
    made = RequestArena(RUN.segment_name("requests0"), SIZE)
    assert made.name.startswith(RUN.prefix) and made.name.endswith("_requests0")
    assert (SHM_DIRECTORY / made.name).stat().st_size == SIZE
    made.close()
    assert not (SHM_DIRECTORY / made.name).exists()
    made.close()  # twice is harmless


def test_blocks_are_disjoint_aligned_and_of_the_size_asked(arena: RequestArena) -> None:
    sizes = (1, 100, 4096, 5000)
    blocks = [arena.allocate(size) for size in sizes]
    spans = []
    for block, size in zip(blocks, sizes, strict=True):
        assert block is not None and block.dtype == np.uint8 and block.nbytes == size
        where = arena.where(block)
        assert where is not None and where.offset % 64 == 0
        spans.append((where.offset, where.offset + size))
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


def test_a_numpy_view_of_a_block_keeps_it_until_the_view_dies(arena: RequestArena) -> None:
    block = arena.allocate(SIZE)
    assert block is not None
    part = block[10:20]
    del block
    gc.collect()
    assert arena.allocate(1) is None
    del part
    gc.collect()
    assert arena.allocate(SIZE) is not None


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


def test_where_finds_views_inside_and_nothing_outside(arena: RequestArena) -> None:
    first = arena.allocate(1000)
    second = arena.allocate(BLOCK)
    assert first is not None and second is not None
    base = arena.where(first.data)
    assert base is not None and base == Residency(Kind.ARENA, arena.name, base.offset, 1000)
    outer = arena.where(second.data)
    assert outer is not None and outer.offset >= base.offset + 1000
    inner = Residency(Kind.ARENA, arena.name, outer.offset + 10, 20)
    assert arena.where(second.data[10:30]) == inner
    # Arrays as well as memoryviews.
    assert arena.where(second) == outer and arena.where(second[10:30]) == inner
    # Memory of its own.
    assert arena.where(memoryview(bytearray(BLOCK))) is None
    assert arena.where(np.zeros(BLOCK, np.uint8).data) is None
    assert arena.where(np.zeros(BLOCK, np.uint8)) is None
    # Empty, or not contiguous.
    assert arena.where(second.data[5:5]) is None and arena.where(second[5:5]) is None
    assert arena.where(second[::2]) is None
    assert arena.where(second.reshape(256, -1).T) is None
    # Typed views count in bytes.
    floats = second.view(np.float32)
    assert arena.where(floats) == outer
    assert arena.where(floats.data) == outer
    assert arena.where(floats.reshape(16, -1).data) == outer


def test_where_a_strided_memoryview_lies_is_none(arena: RequestArena) -> None:
    block = arena.allocate(BLOCK)
    assert block is not None
    assert arena.where(block.data[::2]) is None


def test_where_in_another_arena_is_none(arena: RequestArena) -> None:
    other = RequestArena(RUN.segment_name("requests1"), SIZE)
    try:
        theirs = other.allocate(100)
        mine = arena.allocate(100)
        assert theirs is not None and mine is not None
        # Whichever of the two lies higher in the address space, neither claims the other's memory.
        assert arena.where(theirs.data) is None and other.where(theirs.data) is not None
        assert other.where(mine.data) is None and arena.where(mine.data) is not None
        del theirs, mine
    finally:
        other.close()


# -- HTTP bodies ---------------------------------------------------------------------------


def test_a_body_is_read_into_a_block_of_the_arena_and_onto_the_heap_when_it_is_full(arena: RequestArena) -> None:
    allocate = body_allocator(arena)
    body = allocate(3 * BLOCK + 1)
    assert len(body) == 3 * BLOCK + 1 and body.format == "B" and not body.readonly
    where = arena.where(body)
    assert where is not None and where.nbytes == 3 * BLOCK + 1
    # Less than BLOCK is left: a body that big goes to memory of its own, as writable.
    spilled = allocate(BLOCK)
    assert len(spilled) == BLOCK and spilled.format == "B" and not spilled.readonly
    assert arena.where(spilled) is None
    spilled[:] = b"\x05" * BLOCK
    assert bytes(spilled) == b"\x05" * BLOCK
    assert arena.where(allocate(BLOCK - 64)) is not None  # what is left still serves
    # The body holds its block until it is dropped.
    del body
    gc.collect()
    again = allocate(SIZE)
    assert arena.where(again) == Residency(Kind.ARENA, arena.name, 0, SIZE)


# -- placing inputs ------------------------------------------------------------------------


def test_an_input_is_copied_into_a_block_the_tensor_holds(arena: RequestArena) -> None:
    data = _random_bytes(BLOCK + 5)
    tensor = Placement(arena, RUN).place("UINT8", (len(data),), memoryview(data))
    where = tensor.where
    assert where is not None and (where.kind, where.segment, where.nbytes) == (Kind.ARENA, arena.name, len(data))
    assert where.offset % 64 == 0
    assert _segment_bytes(arena.name, where.offset, where.nbytes) == data
    assert bytes(tensor.array) == data
    # The block (BLOCK + 64 bytes) stays taken while the tensor lives, and comes back once it is dropped.
    assert arena.allocate(SIZE - BLOCK) is None
    del tensor
    gc.collect()
    assert arena.allocate(SIZE) is not None


def test_an_input_read_into_the_arena_stays_where_it_lies(arena: RequestArena) -> None:
    body = body_allocator(arena)(2 * BLOCK)
    body[:] = bytes(range(256)) * (2 * BLOCK // 256)
    first, second = body[:BLOCK], body[BLOCK:]
    placement = Placement(arena, RUN)
    left = placement.place("UINT8", (BLOCK,), first)
    right = placement.place("FP32", (BLOCK // 4,), second)
    assert left.where == arena.where(first) and right.where == arena.where(second)
    assert left.where is not None and right.where is not None and right.where.offset == left.where.offset + BLOCK
    np.testing.assert_array_equal(right.array, np.frombuffer(bytes(second), dtype="<f4"))
    # Nothing was copied: the rest of the arena is free...
    assert arena.allocate(SIZE - 2 * BLOCK) is not None
    # ...and the tensor is a view of the body, not a copy of it.
    first[:4] = b"\xff\xfe\xfd\xfc"
    assert bytes(left.array[:4]) == b"\xff\xfe\xfd\xfc"
    # The tensors hold the body's block once the request's own views are gone.
    del body, first, second
    gc.collect()
    assert arena.allocate(2 * BLOCK + 1) is None
    del left, right
    gc.collect()
    assert arena.allocate(SIZE) is not None


@pytest.mark.parametrize(
    ("datatype", "array"),
    [
        ("FP32", np.arange(24, dtype=np.float32).reshape(4, 6)),
        ("FP32", np.arange(24, dtype=">f4").reshape(4, 6)),  # big-endian: placed little-endian
        ("INT64", np.arange(24, dtype=np.int64).reshape(4, 6).T),  # not contiguous: placed row-major
        ("BYTES", np.array([[b"a", b""], [b"\x00bc", b"longer element"]], dtype=np.object_)),  # framed
    ],
)
def test_an_array_input_is_placed_as_its_wire_bytes(arena: RequestArena, datatype: str, array: np.ndarray) -> None:
    tensor = Placement(arena, RUN).place(datatype, array.shape, array)
    wire = bytes(bytes_codec.wire_bytes(datatype, array))
    where = tensor.where
    assert where is not None and (where.kind, where.segment, where.nbytes) == (Kind.ARENA, arena.name, len(wire))
    assert _segment_bytes(arena.name, where.offset, where.nbytes) == wire
    assert tensor.shape == array.shape and tensor.datatype == datatype
    np.testing.assert_array_equal(tensor.array, array)


def test_framed_bytes_elements_are_placed_as_they_came(arena: RequestArena) -> None:
    elements = np.array([b"first", b"", b"third"], dtype=np.object_)
    framed = bytes_codec.serialize(elements)
    tensor = Placement(arena, RUN).place("BYTES", (3,), memoryview(framed))
    assert tensor.where is not None and tensor.where.kind == Kind.ARENA
    assert bytes(tensor.framed()) == framed
    np.testing.assert_array_equal(tensor.array, elements)


def test_a_placed_input_crosses_as_where_it_lies_and_is_read_there(arena: RequestArena) -> None:
    values = np.arange(BLOCK // 4, dtype=np.float32).reshape(8, -1)
    tensor = Placement(arena, RUN).place("FP32", values.shape, values)
    message = pickle.dumps(tensor, protocol=5)
    assert len(message) < 1024  # the bytes do not travel
    crossed = pickle.loads(message)
    assert crossed.where == tensor.where and crossed.lease is None
    np.testing.assert_array_equal(crossed.array, values)


def test_an_array_read_from_a_placed_input_holds_its_block_and_outlives_the_segment_name(
    arena: RequestArena,
) -> None:
    values = np.arange(BLOCK // 4, dtype=np.float32)
    tensor = Placement(arena, RUN).place("FP32", values.shape, values)
    array = tensor.array
    del tensor
    gc.collect()
    assert arena.allocate(SIZE - BLOCK + 1) is None  # the array still reads the block
    arena.close()  # unlinked: the mapping stays valid while its views live
    np.testing.assert_array_equal(array, values)
    del array
    gc.collect()
    assert arena.allocate(SIZE) is not None


# -- when the arena is full, or there is none ----------------------------------------------


def test_with_a_full_arena_an_input_gets_a_segment_of_its_own_until_the_tensor_goes(arena: RequestArena) -> None:
    filler = arena.allocate(SIZE)
    assert filler is not None
    data = _random_bytes(1000)
    placement = Placement(arena, RUN)
    tensor = placement.place("UINT8", (1000,), memoryview(data))
    where = tensor.where
    assert where is not None and where.kind == Kind.ONE_OFF and (where.offset, where.nbytes) == (0, 1000)
    assert where.segment != arena.name and where.segment.startswith(RUN.prefix)
    path = SHM_DIRECTORY / where.segment
    assert _segment_bytes(where.segment, 0, 1000) == data
    assert pickle.loads(pickle.dumps(tensor)).where == where
    view = tensor.array[10:20]  # a reader's view holds the segment too
    assert bytes(view) == data[10:20]
    del tensor
    gc.collect()
    assert path.exists()
    del view
    gc.collect()
    assert not path.exists()
    # Once the arena has room again, inputs go there.
    del filler
    gc.collect()
    placed = placement.place("UINT8", (1000,), memoryview(data))
    assert placed.where is not None and placed.where.segment == arena.name


def test_without_an_arena_every_input_gets_a_segment_of_its_own() -> None:
    placement = Placement(None, RUN)
    values = np.arange(10, dtype=np.int32)
    tensors = [
        placement.place("INT32", (10,), values),
        placement.place("INT32", (10,), memoryview(values.tobytes())),
    ]
    paths = []
    for tensor in tensors:
        where = tensor.where
        assert where is not None and where.kind == Kind.ONE_OFF and where.nbytes == values.nbytes
        assert where.segment.startswith(RUN.prefix)
        np.testing.assert_array_equal(tensor.array, values)
        paths.append(SHM_DIRECTORY / where.segment)
    assert paths[0] != paths[1] and all(path.exists() for path in paths)
    del tensor, tensors
    gc.collect()
    assert not any(path.exists() for path in paths)


def test_request_arena_makes_the_arena() -> None:
    made = request_arena(RUN.segment_name("requests0"), SIZE)
    assert isinstance(made, RequestArena)
    try:
        assert (SHM_DIRECTORY / made.name).stat().st_size == SIZE
        assert made.allocate(SIZE) is not None
    finally:
        made.close()


@pytest.mark.parametrize(
    ("code", "error", "logged"),
    [
        (errno.ENOSPC, UnavailableError, f"not enough shared memory for a request arena of {SIZE} bytes"),
        (errno.ENOMEM, UnavailableError, f"not enough shared memory for a request arena of {SIZE} bytes"),
        (errno.EIO, OSError, "reserving failed"),
    ],
)
def test_no_request_arena_where_shared_memory_cannot_hold_it(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    code: int,
    error: type[Exception],
    logged: str,
) -> None:
    def refuse(descriptor: int, offset: int, length: int) -> None:
        raise OSError(code, "reserving failed")

    monkeypatch.setattr(os, "posix_fallocate", refuse)
    name = RUN.segment_name("requests0")
    with pytest.raises(error):
        RequestArena(name, SIZE)
    assert not (SHM_DIRECTORY / name).exists()
    with caplog.at_level(logging.WARNING, logger="geserve.frontdoor.arena"):
        assert request_arena(name, SIZE) is None
    assert not (SHM_DIRECTORY / name).exists()
    [record] = [record for record in caplog.records if record.name == "geserve.frontdoor.arena"]
    assert record.levelno == logging.WARNING and logged in record.getMessage()
    assert "no request arena" in record.getMessage()


def test_no_request_arena_under_a_name_taken_and_the_segment_there_is_left_alone(
    arena: RequestArena, caplog: pytest.LogCaptureFixture
) -> None:
    block = arena.allocate(4)
    assert block is not None
    block[:] = 7
    with caplog.at_level(logging.WARNING, logger="geserve.frontdoor.arena"):
        assert request_arena(arena.name, SIZE) is None
    assert "no request arena" in caplog.text
    assert (SHM_DIRECTORY / arena.name).stat().st_size == SIZE
    assert _segment_bytes(arena.name, 0, 4) == b"\x07" * 4
