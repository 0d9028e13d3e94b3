"""The HTTP connection count every protocol process shares: one slot each, totals over all of them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from geserve.multiprocess.connection_count import SharedConnectionCount, create_counts, remove_counts
from geserve.workers.runs import RunId
from geserve.workers.shm import SHM_DIRECTORY

RUN = RunId.current()


@pytest.fixture
def counts() -> Iterator[str]:
    name = create_counts(RUN, 3)
    yield name
    remove_counts(name)
    assert not (SHM_DIRECTORY / name).exists()


def test_the_segment_holds_one_zeroed_count_per_process(counts: str) -> None:
    assert counts.startswith(RUN.prefix) and counts.endswith("_connections")
    path = SHM_DIRECTORY / counts
    assert path.stat().st_size == 3 * 8 and path.read_bytes() == bytes(24)
    assert path.stat().st_mode & 0o777 == 0o600  # no other user reads or changes the cap


def test_totals_add_every_process_up(counts: str) -> None:
    first, second = SharedConnectionCount(counts, 0), SharedConnectionCount(counts, 2)
    assert first.total(0) == 0 and second.total(0) == 0
    first.update(3)
    second.update(5)
    assert first.total(3) == 8 and second.total(5) == 8
    # Each counts its own connections as it knows them now, not as its slot last said.
    assert first.total(4) == 9 and second.total(0) == 3
    first.update(1)
    assert second.total(5) == 6
    second.update(0)
    assert first.total(1) == 1


def test_a_restarted_process_starts_from_zero_and_leaves_the_others(counts: str) -> None:
    first, second = SharedConnectionCount(counts, 0), SharedConnectionCount(counts, 1)
    first.update(4)
    second.update(7)
    # Process 1 died with its connections; its successor takes the same slot.
    successor = SharedConnectionCount(counts, 1)
    assert successor.total(0) == 4 and first.total(4) == 4
    successor.update(2)
    assert first.total(4) == 6
    del second  # the predecessor's mapping goes without touching the counts
    assert first.total(4) == 6


def test_counts_of_two_runs_are_their_own() -> None:
    first, second = create_counts(RUN, 2), create_counts(RUN, 2)
    try:
        assert first != second
        SharedConnectionCount(first, 0).update(9)
        assert SharedConnectionCount(second, 1).total(0) == 0
    finally:
        remove_counts(first)
        remove_counts(second)


def test_remove_counts_removes_the_segment_once(counts: str) -> None:
    SharedConnectionCount(counts, 0).update(1)
    remove_counts(counts)
    assert not (SHM_DIRECTORY / counts).exists()
    remove_counts(counts)  # already gone: not an error
    with pytest.raises(FileNotFoundError):
        SharedConnectionCount(counts, 0)
