"""SharedMemoryManager's caps: counted per region and per byte, freed on unregister, and a descriptor shortage named."""

from __future__ import annotations

import errno
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from geserve.core import shared_memory
from geserve.core.shared_memory import RegionLimits, SharedMemoryManager
from geserve.errors import InvalidArgumentError, UnavailableError


@pytest.fixture
def segment() -> Iterator[str]:
    key = f"geserve-unit-limit-{uuid.uuid4().hex}"
    path = Path(shared_memory.SHM_DIRECTORY) / key
    path.write_bytes(bytes(1024))
    yield key
    path.unlink()


def test_the_region_cap_counts_registrations_and_unregistering_frees_one(
    segment: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = SharedMemoryManager(True, limits=RegionLimits(regions=2, byte_size=1 << 20))
    manager.register("a", segment, 0, 16)
    manager.register("b", segment, 16, 16)
    # The manager's own opens and closes are counted: the process's descriptor count moves with whatever else
    # the test process (a garbage-collected socket, a thread) does meanwhile.
    opened: list[int] = []
    closed: list[int] = []
    real_open, real_close = os.open, os.close

    def counted_open(*args: Any, **kwargs: Any) -> int:
        fd = real_open(*args, **kwargs)
        opened.append(fd)
        return fd

    def counted_close(fd: int) -> None:
        closed.append(fd)
        real_close(fd)

    monkeypatch.setattr(shared_memory.os, "open", counted_open)
    monkeypatch.setattr(shared_memory.os, "close", counted_close)
    for _ in range(20):
        with pytest.raises(InvalidArgumentError, match=r"'c': 2 regions are registered.*--max-client-shm-regions"):
            manager.register("c", segment, 32, 16)
    monkeypatch.undo()
    assert len(opened) == 20 and opened == closed  # a refused region keeps no descriptor
    manager.unregister("a")
    manager.register("c", segment, 32, 16)
    assert sorted(region["name"] for region in manager.status()) == ["b", "c"]
    manager.close()


def test_the_byte_cap_sums_the_registered_sizes(segment: str) -> None:
    manager = SharedMemoryManager(True, limits=RegionLimits(regions=10, byte_size=1000))
    manager.register("a", segment, 0, 600)
    with pytest.raises(
        InvalidArgumentError, match=r"'b': its 401 bytes, with the 600 .*--max-client-shm-bytes \(1000\)"
    ):
        manager.register("b", segment, 0, 401)
    manager.register("b", segment, 0, 400)  # exactly the cap
    manager.close()


def test_no_descriptor_left_is_said_as_such(segment: str, monkeypatch: pytest.MonkeyPatch) -> None:
    manager = SharedMemoryManager(True)

    def exhausted(*_: object, **__: object) -> int:
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    monkeypatch.setattr(shared_memory.os, "open", exhausted)
    with pytest.raises(UnavailableError, match="'a': the server has no file descriptor left"):
        manager.register("a", segment, 0, 16)
