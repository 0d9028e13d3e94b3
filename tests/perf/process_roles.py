"""CPU time of a geserve server's process tree, split by role: server, supervisor, protocol, engine, worker."""

from __future__ import annotations

import os
from pathlib import Path

from tests.support import children, command_line, multiprocess_role

# N=1: one `server` process (protocol and engine in one) and its workers. N>=2: the `supervisor` the user
# started, one `engine`, N `protocol` processes, and the engine's workers.
ROLES = ("server", "supervisor", "protocol", "engine", "worker")


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of one process (all its threads), None once it has gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _is_resource_tracker(pid: int) -> bool:
    return any("multiprocessing.resource_tracker" in argument for argument in command_line(pid))


def process_roles(top: int) -> dict[int, str]:
    """The role of `top` and of each process below it now. multiprocessing's resource tracker, started beside
    the workers, is counted with the process that started it: it is no instance."""
    parents: dict[int, int] = {}
    pending = [top]
    while pending:
        parent = pending.pop()
        for child in children(parent):
            parents[child] = parent
            pending.append(child)
    named = {pid: multiprocess_role(pid) for pid in parents}
    split = any(named.values())  # the top process is a supervisor only where it runs an engine and protocols
    roles = {top: "supervisor" if split else "server"}
    for pid in sorted(parents, key=lambda pid: _depth(pid, parents)):
        if named[pid]:
            roles[pid] = str(named[pid])
        elif _is_resource_tracker(pid):
            roles[pid] = roles[parents[pid]]
        else:
            roles[pid] = "worker"
    return roles


def _depth(pid: int, parents: dict[int, int]) -> int:
    depth = 0
    while pid in parents:
        pid, depth = parents[pid], depth + 1
    return depth


class RoleCpu:
    """CPU seconds each role spent between `start()` and `stop()`.

    A process that appears during the window counts whole (it started inside it); one that ends during the
    window loses its last stretch, which /proc no longer shows: workers are not restarted in a healthy run."""

    def __init__(self, top: int) -> None:
        self._top = top
        self._before: dict[int, tuple[str, float]] = {}

    def start(self) -> None:
        self._before = self._snapshot()

    def stop(self) -> dict[str, float]:
        after = self._snapshot()
        spent = dict.fromkeys(ROLES, 0.0)
        for pid, (role, seconds) in after.items():
            earlier = self._before.get(pid)
            spent[role] += seconds - (earlier[1] if earlier and earlier[0] == role else 0.0)
        return spent

    def _snapshot(self) -> dict[int, tuple[str, float]]:
        readings: dict[int, tuple[str, float]] = {}
        for pid, role in process_roles(self._top).items():
            seconds = cpu_seconds(pid)
            if seconds is not None:
                readings[pid] = (role, seconds)
        return readings

    def counts(self) -> dict[str, int]:
        """How many processes hold each role now (resource trackers left out)."""
        tally = dict.fromkeys(ROLES, 0)
        for pid, role in process_roles(self._top).items():
            tally[role] += 0 if _is_resource_tracker(pid) else 1
        return tally
