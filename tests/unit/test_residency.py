"""SharedTensor: descriptors that cross processes as a few fields, read only where an array is asked for."""

from __future__ import annotations

import gc
import os
import pickle
import secrets
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from geserve.codecs import bytes as bytes_codec
from geserve.errors import InvalidArgumentError
from geserve.residency import (
    MAPPINGS,
    SHM_DIRECTORY,
    Kind,
    Lease,
    Residency,
    SharedTensor,
    gather,
    unreadable_rows,
    zeroed,
)


@pytest.fixture
def segment() -> Iterator[Path]:
    """A 1 MiB segment of its own under /dev/shm."""
    path = SHM_DIRECTORY / f"geserve-test-{secrets.token_hex(8)}"
    path.write_bytes(bytes(1 << 20))
    yield path
    MAPPINGS.forget(path.name)
    path.unlink(missing_ok=True)


def _put(path: Path, offset: int, data: bytes) -> None:
    with path.open("r+b") as file:
        file.seek(offset)
        file.write(data)


def test_a_tensor_in_a_segment_crosses_as_its_descriptor_and_is_mapped_only_when_read(segment: Path) -> None:
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    _put(segment, 128, values.tobytes())
    tensor = SharedTensor("FP32", (3, 4), Residency(Kind.ARENA, segment.name, 128, values.nbytes))
    data = pickle.dumps(tensor)
    assert len(data) < 200  # the descriptor, not the 48 bytes of data and a numpy header
    MAPPINGS.forget(segment.name)
    copy = pickle.loads(data)
    assert segment.name not in MAPPINGS.names()
    assert copy.shape == (3, 4) and copy.nbytes == 48 and copy.dtype == np.float32
    assert segment.name not in MAPPINGS.names()  # what it is needs no read
    np.testing.assert_array_equal(copy.array, values)
    assert segment.name in MAPPINGS.names()


def test_rows_and_reshapes_are_offsets_not_reads(segment: Path) -> None:
    values = np.arange(20, dtype=np.int32).reshape(5, 4)
    _put(segment, 0, values.tobytes())
    tensor = SharedTensor("INT32", (5, 4), Residency(Kind.ARENA, segment.name, 0, values.nbytes))
    rows = tensor.rows(1, 3)
    assert rows.where is not None and rows.where.offset == 16 and rows.where.nbytes == 48
    np.testing.assert_array_equal(rows.array, values[1:4])
    np.testing.assert_array_equal(tensor.reshaped((20,)).array, values.reshape(-1))
    assert tensor.rows(0, 5) is tensor


def test_a_local_tensor_crosses_by_value() -> None:
    copy = pickle.loads(pickle.dumps(SharedTensor.local(np.arange(3.0))))
    assert copy.where is None
    np.testing.assert_array_equal(copy.array, [0.0, 1.0, 2.0])


def test_gather_views_a_single_part_and_copies_several_once(segment: Path) -> None:
    first = np.arange(8, dtype=np.float32).reshape(2, 4)
    second = np.arange(8, 12, dtype=np.float32).reshape(1, 4)
    _put(segment, 0, first.tobytes())
    _put(segment, 64, second.tobytes())
    parts = [
        SharedTensor("FP32", (2, 4), Residency(Kind.ARENA, segment.name, 0, 32)),
        SharedTensor.local(second),
        SharedTensor.zeros("FP32", (1, 4)),
        SharedTensor("FP32", (1, 4), Residency(Kind.ARENA, segment.name, 64, 16)),
    ]
    whole = gather(parts, "FP32")
    np.testing.assert_array_equal(whole, np.concatenate([first, second, np.zeros((1, 4)), second]))
    alone = gather(parts[:1], "FP32")
    assert not alone.flags.owndata  # a view of the segment, not a copy
    np.testing.assert_array_equal(alone, first)


def test_bytes_tensors_are_framed_where_they_lie_and_gathered_by_their_elements(segment: Path) -> None:
    framed = bytes_codec.serialize(np.array([b"ab", b"", b"cde"], dtype=np.object_))
    _put(segment, 0, framed)
    tensor = SharedTensor("BYTES", (1, 3), Residency(Kind.ARENA, segment.name, 0, len(framed)))
    assert tensor.array.tolist() == [[b"ab", b"", b"cde"]]
    gathered = gather([tensor, SharedTensor.zeros("BYTES", (1, 3))], "BYTES")
    assert gathered.tolist() == [[b"ab", b"", b"cde"], [b"", b"", b""]]
    with pytest.raises(ValueError, match="BYTES"):
        tensor.rows(0, 0)


def test_a_client_region_is_read_through_its_file_and_a_shrunk_or_replaced_one_is_refused(segment: Path) -> None:
    values = np.arange(4, dtype=np.int64)
    _put(segment, 1024, values.tobytes())
    inode = os.stat(segment).st_ino
    tensor = SharedTensor("INT64", (4,), Residency(Kind.CLIENT, segment.name, 1024, 32, inode))
    np.testing.assert_array_equal(tensor.array, values)
    assert tensor.array.flags.owndata  # a copy: the client may rewrite its region meanwhile
    assert segment.name not in MAPPINGS.names()
    shrunk = SharedTensor("INT64", (4,), Residency(Kind.CLIENT, segment.name, (1 << 20) - 8, 32, inode, "mine"))
    with pytest.raises(InvalidArgumentError) as error:
        _ = shrunk.array
    assert error.value.message == (
        f"shared memory region 'mine' shrank to {1 << 20} bytes: its segment '/{segment.name}' no longer holds the "
        f"{(1 << 20) + 24} bytes the request uses"
    )
    replaced = SharedTensor("INT64", (4,), Residency(Kind.CLIENT, segment.name, 1024, 32, inode + 1, "mine"))
    with pytest.raises(InvalidArgumentError, match="shared memory region 'mine' was replaced"):
        _ = replaced.array


def test_only_the_requests_whose_region_cannot_be_read_are_refused_and_their_rows_run_as_zeros(segment: Path) -> None:
    inode = os.stat(segment).st_ino
    _put(segment, 0, np.arange(8, dtype=np.int32).tobytes())
    good = SharedTensor("INT32", (1, 4), Residency(Kind.CLIENT, segment.name, 0, 16, inode, "mine"))
    local = SharedTensor.local(np.full((1, 4), 9, np.int32))
    shrunk = SharedTensor("INT32", (1, 4), Residency(Kind.CLIENT, segment.name, (1 << 20) - 4, 16, inode, "mine"))
    inputs = [[good, shrunk, local], [local, local, local]]  # two inputs, three requests
    refused = unreadable_rows(inputs, 3)
    assert list(refused) == [1] and "region 'mine' shrank" in refused[1].message
    with pytest.raises(InvalidArgumentError):
        gather(inputs[0], "INT32")
    rows = gather(zeroed(inputs[0], refused), "INT32")
    np.testing.assert_array_equal(rows, [[0, 1, 2, 3], [0, 0, 0, 0], [9, 9, 9, 9]])
    assert unreadable_rows([[good, local]], 3) == {}  # parts not one per request: not told apart


def test_a_lease_is_released_once_the_last_tensor_and_view_holding_it_are_gone(segment: Path) -> None:
    released: list[object] = []
    lease = Lease("batch-7", released.append)
    tensor = SharedTensor("UINT8", (16,), Residency(Kind.ARENA, segment.name, 0, 16), lease=lease)
    del lease
    view = tensor.array[4:8]
    del tensor
    gc.collect()
    assert released == []  # the view still reads the bytes
    del view
    gc.collect()
    assert released == ["batch-7"]
