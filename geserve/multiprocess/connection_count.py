"""What protocol processes' HTTP listeners share in one mapping: connection counts, listening flags."""

# So --http-max-connections caps the server, not each process; each slot is written only by its own process.
# The mapping is anonymous and made by the supervisor before it forks: every protocol process, a restarted one
# too, inherits it, and nothing is left in /dev/shm whichever way the server ends.

from __future__ import annotations

import mmap

import numpy as np


def create_counts(processes: int) -> mmap.mmap:
    """The supervisor's zeroed slots (a connection count, then a listening flag, per process), shared with the
    processes it forks afterwards."""
    return mmap.mmap(-1, 2 * 8 * processes, flags=mmap.MAP_SHARED)


def _slots(counts: mmap.mmap) -> tuple[np.ndarray, np.ndarray]:
    both = np.frombuffer(counts, dtype=np.int64)
    half = len(both) // 2
    return both[:half], both[half:]


class SharedConnectionCount:
    """Protocol process `index`'s view of the counts (http.connections.OpenConnections). A burst that reaches
    several processes at once may admit up to one connection per process over the cap."""

    def __init__(self, counts: mmap.mmap, index: int) -> None:
        self._counts = _slots(counts)[0]
        self._index = index
        self._counts[index] = 0  # a restarted process's connections died with its predecessor

    def total(self, own: int) -> int:
        return int(self._counts.sum()) - int(self._counts[self._index]) + own

    def update(self, own: int) -> None:
        self._counts[self._index] = own


class SharedListening:
    """Whether any protocol process still holds the shared listening socket open (http.connections.Listening).
    The socket stops listening only once every process has closed it; connections the kernel queues until then
    and no one accepts are reset. So a process closes its connections only once the socket is closed everywhere:
    before that, a client whose connection it closed would reconnect into that queue."""

    def __init__(self, counts: mmap.mmap, index: int) -> None:
        self._listening = _slots(counts)[1]
        self._index = index

    def opened(self) -> None:
        self._listening[self._index] = 1

    def closed(self) -> None:
        self._listening[self._index] = 0

    def closed_everywhere(self) -> bool:
        return not self._listening.any()


def forget_listener(counts: mmap.mmap, index: int) -> None:
    """Protocol process `index` died: its copy of the listening socket closed with it (the supervisor's call)."""
    _slots(counts)[1][index] = 0
