"""Run ids: what a segment's name says about its owner, when that run counts as gone, and what the sweep removes."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from geserve.workers.runs import RunId, run_of, sweep_orphaned_segments

HEX = "0123456789abcdef" * 2


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _exited_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_a_run_is_this_process_and_its_start_time_and_names_carry_it() -> None:
    run = RunId.current()
    assert run.pid == os.getpid()
    assert run.started == int(_stat(run.pid)[19]) > 0
    name = run.segment_name("in")
    assert run.namespace == os.stat("/proc/self/ns/pid").st_ino
    assert name.startswith(f"geserve_{run.pid}-{run.started}-{run.namespace}_") and name.endswith("_in")
    assert run_of(name) == run
    assert run.segment_name("in") != name  # 128 random bits each


def test_names_of_older_servers_and_of_others_parse_as_expected() -> None:
    assert run_of(f"geserve_42_{HEX}_out") == RunId(42, 0)  # before start times: the pid alone
    assert run_of(f"geserve_42-7_{HEX}_out") == RunId(42, 7)  # before pid namespaces
    assert run_of("geserve_0123") is None  # a client's region, not a server's
    assert run_of(f"other_42-7_{HEX}_in") is None


def test_a_run_is_gone_once_its_pid_is_gone_or_is_another_process_or_a_zombie() -> None:
    current = RunId.current()
    assert current.alive()
    assert RunId(current.pid, 0).alive()  # an older server's name: the pid decides
    assert not RunId(current.pid, current.started + 1).alive()  # the pid, reused by a later process
    assert not RunId(_exited_pid(), 0).alive()
    zombie = subprocess.Popen(["true"])
    try:
        deadline = time.monotonic() + 10
        while _stat(zombie.pid)[0] != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not RunId(zombie.pid, int(_stat(zombie.pid)[19])).alive()
    finally:
        zombie.wait()


def test_a_run_of_another_pid_namespace_is_never_judged_gone() -> None:
    # Containers of one pod share /dev/shm; the other one's server may be pid 1 of its own namespace.
    current = RunId.current()
    other = RunId(1, current.started + 1, current.namespace + 1)
    assert other.alive()
    assert run_of(other.segment_name("in")) == other


def test_the_sweep_removes_only_the_segments_of_runs_that_are_gone(tmp_path: Path) -> None:
    current = RunId.current()
    dead_pid = _exited_pid()
    elsewhere = RunId(dead_pid, 12345, current.namespace + 1).segment_name("in")  # another container's
    live = [current.segment_name("in"), f"geserve_{current.pid}_{HEX}_out", "geserve_0123", "other", elsewhere]
    gone = [
        RunId(current.pid, current.started + 1).segment_name("in"),
        RunId(dead_pid, 12345).segment_name("handoff"),
        f"geserve_{dead_pid}_{HEX}_out",
    ]
    for name in live + gone:
        (tmp_path / name).touch()
    assert sorted(sweep_orphaned_segments(tmp_path)) == sorted(gone)
    assert sorted(entry.name for entry in tmp_path.iterdir()) == sorted(live)
    assert sweep_orphaned_segments(tmp_path / "missing") == []
