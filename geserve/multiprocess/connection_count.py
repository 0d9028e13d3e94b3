"""The HTTP connection count of all protocol processes in one shared mapping, one slot per process."""

# So --http-max-connections caps the server, not each process; each slot is written only by its own process.
# The mapping is anonymous and made by the supervisor before it forks: every protocol process, a restarted one
# too, inherits it, and nothing is left in /dev/shm whichever way the server ends.

from __future__ import annotations

import mmap

import numpy as np


def create_counts(processes: int) -> mmap.mmap:
    """The supervisor's zeroed counts, shared with the processes it forks afterwards."""
    return mmap.mmap(-1, 8 * processes, flags=mmap.MAP_SHARED)


class SharedConnectionCount:
    """Protocol process `index`'s view of the counts (http.connections.OpenConnections). A burst that reaches
    several processes at once may admit up to one connection per process over the cap."""

    def __init__(self, counts: mmap.mmap, index: int) -> None:
        self._counts = np.frombuffer(counts, dtype=np.int64)
        self._index = index
        self._counts[index] = 0  # a restarted process's connections died with its predecessor

    def total(self, own: int) -> int:
        return int(self._counts.sum()) - int(self._counts[self._index]) + own

    def update(self, own: int) -> None:
        self._counts[self._index] = own
