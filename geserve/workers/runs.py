"""Who owns a shared-memory segment: the server run whose id its name carries; sweeping those of runs that are gone."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from geserve.workers.shm import SHM_DIRECTORY, SHM_PREFIX

# geserve_<pid>-<start>-<pid namespace>_<128 random bits>_<role>; names without "-<start>" or "-<namespace>" are
# those of older servers.
_OWNED_NAME = re.compile(rf"^{SHM_PREFIX}(\d+)(?:-(\d+))?(?:-(\d+))?_[0-9a-f]{{32}}_")
_PROC = Path("/proc")


@dataclass(frozen=True, slots=True)
class RunId:
    """One server run: the pid of its top-level process and that process's start time (clock ticks since boot,
    /proc/<pid>/stat's starttime; 0 where /proc cannot tell). Every segment a process of the run creates carries
    it in its name, whichever process creates it (the front-end, a worker, or a process a worker started), so
    the id is made once, by the server, and handed to each of them (the worker spec carries it).

    The run is alive while a process with that pid runs and started at that time: the start time tells a
    reused pid from the server that had it, which the pid alone cannot. A zombie is gone. The pid and its start
    time mean something only in the pid namespace they were read in (the inode of /proc/self/ns/pid; 0 where
    unknown): containers of one pod share /dev/shm but not their pids, and each server may be pid 1 of its own,
    so a run of another namespace is never judged gone."""

    pid: int
    started: int
    namespace: int = 0

    @classmethod
    def current(cls) -> RunId:
        """The run of which this process is the top: what a server (or a test standing in for one) owns."""
        pid = os.getpid()
        return cls(pid, _start_time(pid) or 0, _pid_namespace())

    @property
    def prefix(self) -> str:
        """The start of every segment name of this run."""
        return f"{SHM_PREFIX}{self.pid}-{self.started}-{self.namespace}_"

    def segment_name(self, role: str) -> str:
        """A fresh name: the run's prefix, 128 random bits (unguessable), and the segment's role."""
        return f"{self.prefix}{secrets.token_hex(16)}_{role}"

    def alive(self) -> bool:
        if self.namespace and self.namespace != _pid_namespace():
            return True  # its pid is not ours to look up
        start = _start_time(self.pid)
        if start is None:
            return False
        # Where either start time is unknown (no /proc; a name of an older server) the pid alone decides.
        return start == self.started or 0 in (start, self.started)


def run_of(name: str) -> RunId | None:
    """The run that owns segment `name`; None for a name no geserve run made."""
    match = _OWNED_NAME.match(name)
    if match is None:
        return None
    return RunId(int(match.group(1)), int(match.group(2) or 0), int(match.group(3) or 0))


def _start_time(pid: int) -> int | None:
    """When process `pid` started (0: it runs, but /proc does not say when); None when it is gone or a zombie."""
    try:
        fields = (_PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        if _PROC.joinpath("self", "stat").is_file():
            return None  # /proc works here: the process is gone
        return 0 if _pid_exists(pid) else None
    return None if fields[0] == "Z" else int(fields[19])


def _pid_namespace() -> int:
    """This process's pid namespace (the inode of /proc/self/ns/pid); 0 where /proc does not say."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def sweep_orphaned_segments(directory: Path = SHM_DIRECTORY) -> list[str]:
    """Unlink the segments of geserve runs that are gone (killed with their workers and the resource tracker, as
    a container's or cgroup's OOM kill does); returns their names. Live runs' segments, another server's on
    this machine included, stay."""
    removed: list[str] = []
    try:
        names = [entry.name for entry in directory.iterdir()]
    except OSError:
        return removed
    alive: dict[RunId, bool] = {}
    for name in names:
        run = run_of(name)
        if run is None:
            continue
        if run not in alive:
            alive[run] = run.alive()
        if alive[run]:
            continue
        with contextlib.suppress(OSError):
            (directory / name).unlink()
            removed.append(name)
    return removed


def remove_run_segments(run: RunId, directory: Path = SHM_DIRECTORY) -> list[str]:
    """Unlink every segment of `run` (whose processes have all exited); returns their names."""
    removed: list[str] = []
    try:
        names = [entry.name for entry in directory.iterdir() if entry.name.startswith(run.prefix)]
    except OSError:
        return removed
    for name in names:
        with contextlib.suppress(OSError):
            (directory / name).unlink()
            removed.append(name)
    return removed
