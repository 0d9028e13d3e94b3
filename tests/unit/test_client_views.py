"""Client regions viewed in place: holes cost nothing, data reads right, a shrink while read is zeros and a torn row."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from geserve import client_views
from geserve.residency import VIEW_CLIENT_BYTES, Kind, Residency, SharedTensor, torn_rows, unreadable_rows

MIB = 1 << 20


@pytest.fixture
def segment() -> Iterator[Path]:
    path = Path(f"/dev/shm/geserve-test-views-{uuid.uuid4().hex}")
    path.touch(mode=0o600)
    yield path
    path.unlink(missing_ok=True)


def _anonymous_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith("RssAnon:"))


def _client_tensor(path: Path, shape: tuple[int, ...], offset: int = 0) -> SharedTensor:
    nbytes = int(np.prod(shape)) * 4
    where = Residency(Kind.CLIENT, path.name, offset, nbytes, path.stat().st_ino, "region")
    return SharedTensor("FP32", shape, where)


def test_a_sparse_region_reads_as_its_data_and_zeros_without_memory_or_filled_holes(segment: Path) -> None:
    size = 256 * MIB
    with open(segment, "r+b") as file:
        os.ftruncate(file.fileno(), size)
        os.pwrite(file.fileno(), b"\x01" * 10_000, 5 * 4096 + 3)
        os.pwrite(file.fileno(), b"\x02" * 7, size - 7)
        anonymous, blocks = _anonymous_mib(), segment.stat().st_blocks
        viewed = client_views.view(file.fileno(), 5, size - 5)
    assert isinstance(viewed, client_views.View)
    assert int(viewed.array.sum(dtype=np.int64)) == 10_000 + 14
    assert viewed.array[5 * 4096 + 3 - 5] == 1 and viewed.array[-1] == 2 and viewed.array[0] == 0
    assert len(viewed.array) == size - 5
    assert _anonymous_mib() - anonymous < 16
    assert segment.stat().st_blocks == blocks, "reading the view filled the region's holes"
    assert not viewed.torn


def test_a_region_in_more_pieces_than_are_mapped_reads_right(segment: Path) -> None:
    pieces = client_views.MAPPED_EXTENTS * 3
    with open(segment, "r+b") as file:
        os.ftruncate(file.fileno(), pieces * 2 * 4096)
        for piece in range(pieces):
            os.pwrite(file.fileno(), bytes([piece % 251 + 1]) * 100, piece * 2 * 4096 + 17)
        expected = np.frombuffer(os.pread(file.fileno(), pieces * 2 * 4096, 0), dtype=np.uint8)
        viewed = client_views.view(file.fileno(), 0, pieces * 2 * 4096)
    assert isinstance(viewed, client_views.View)
    np.testing.assert_array_equal(viewed.array, expected)


def test_a_region_smaller_than_the_view_is_a_shortfall(segment: Path) -> None:
    with open(segment, "r+b") as file:
        os.ftruncate(file.fileno(), 4096)
        assert client_views.view(file.fileno(), 100, 4096) == client_views.Shortfall(4096, 4196)


def test_a_region_shrunk_under_a_view_reads_as_zeros_and_tears_its_row(segment: Path) -> None:
    size = 4 * VIEW_CLIENT_BYTES
    segment.write_bytes(np.full(size // 4, 3.0, dtype=np.float32).tobytes())
    torn = _client_tensor(segment, (size // 4,))
    small = _client_tensor(segment, (16,))
    viewed = torn.in_place()
    assert small.in_place().sum() == 48.0  # a small tensor is copied: the shrink below does not reach it
    assert viewed[0] == 3.0 and not torn_rows([[torn]], 1)
    os.truncate(segment, 4096)  # the client shrinks its region while the batch reads it
    assert float(viewed.sum()) < size // 4 * 3.0
    assert not viewed[-16:].any()
    errors = torn_rows([[small, torn]], 2)
    assert list(errors) == [1]
    assert "shared memory region 'region' shrank while the request's input was read" in errors[1].message
    refused = unreadable_rows([[small, _client_tensor(segment, (size // 4,))]], 2)
    assert list(refused) == [1] and "shrank to 4096 bytes" in refused[1].message


def test_a_view_shrunk_while_threads_copy_it_without_the_gil_zeroes_it_and_nothing_dies(segment: Path) -> None:
    size = 64 * MIB
    segment.write_bytes(b"\x05" * size)
    with open(segment, "r+b") as file:
        viewed = client_views.view(file.fileno(), 0, size)
    assert isinstance(viewed, client_views.View)
    started = threading.Barrier(4)

    def copy() -> None:
        target = np.empty(size, dtype=np.uint8)
        started.wait()
        for _ in range(50):
            np.copyto(target, viewed.array)  # numpy lets go of the GIL for a copy this large

    threads = [threading.Thread(target=copy) for _ in range(3)]
    for thread in threads:
        thread.start()
    started.wait()
    os.truncate(segment, 0)
    for thread in threads:
        thread.join()
    assert viewed.torn and not viewed.array.any()


def test_a_fault_outside_every_view_still_kills_the_process(segment: Path) -> None:
    """The guard hides nothing else: a mapping of its own that a process reads past the end of its file is fatal."""
    script = textwrap.dedent(
        f"""
        import mmap, os
        from geserve import client_views
        with open({str(segment)!r}, "r+b") as file:
            os.ftruncate(file.fileno(), 8192)
            guarded = client_views.view(file.fileno(), 0, 4096)
            plain = mmap.mmap(file.fileno(), 8192)
            os.ftruncate(file.fileno(), 0)
        print(guarded.array.sum(), flush=True)
        print(plain[4096], flush=True)
        """
    )
    ran = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=60)
    assert ran.stdout.splitlines() == ["0"], ran.stderr
    assert ran.returncode == -7, (ran.returncode, ran.stderr)  # SIGBUS
