"""The HTTP connection count of all protocol processes, so that --http-max-connections caps the server, not each
process: one int64 per process in a small shared segment, each written only by its own process."""

from __future__ import annotations

import mmap

import numpy as np

from geserve.workers.runs import RunId
from geserve.workers.shm import SHM_DIRECTORY, create_segment, unlink_quietly


def create_counts(run: RunId, processes: int) -> str:
    """The supervisor's segment of `processes` zeroed counts; returns its name."""
    name = run.segment_name("connections")
    create_segment(name, 8 * processes).close()
    return name


def remove_counts(name: str) -> None:
    unlink_quietly(name)


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
