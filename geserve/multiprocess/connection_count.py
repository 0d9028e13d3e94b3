"""The HTTP connection count of all protocol processes in one shared segment, one slot per process."""

# So --http-max-connections caps the server, not each process; each slot is written only by its own process.

from __future__ import annotations

import contextlib
import mmap
import os

import numpy as np

from geserve.workers.runs import RunId
from geserve.workers.shm import SHM_DIRECTORY


def create_counts(run: RunId, processes: int) -> str:
    """The supervisor's segment of `processes` zeroed counts; returns its name. Made with plain file calls:
    multiprocessing's SharedMemory would start a resource tracker here, a child every forked process shares."""
    name = run.segment_name("connections")
    descriptor = os.open(SHM_DIRECTORY / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(descriptor, 8 * processes)
    finally:
        os.close(descriptor)
    return name


def remove_counts(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        (SHM_DIRECTORY / name).unlink()


class SharedConnectionCount:
    """Protocol process `index`'s view of the counts (http.connections.OpenConnections). A burst that reaches
    several processes at once may admit up to one connection per process over the cap."""

    def __init__(self, name: str, index: int) -> None:
        with open(SHM_DIRECTORY / name, "r+b") as file:
            self._mapping = mmap.mmap(file.fileno(), 0)
        self._counts = np.frombuffer(self._mapping, dtype=np.int64)
        self._index = index
        self._counts[index] = 0  # a restarted process's connections died with its predecessor

    def total(self, own: int) -> int:
        return int(self._counts.sum()) - int(self._counts[self._index]) + own

    def update(self, own: int) -> None:
        self._counts[self._index] = own
