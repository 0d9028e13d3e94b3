"""A front-end killed outright: its workers (and, under a supervisor, its engine and protocol processes) exit, and
no shared-memory segment of it survives."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from geserve.workers.shm import SHM_DIRECTORY
from tests.support import GeserveProcess, alive, copy_model, descendants, segments_of_server, wait_until, worker_pids

pytestmark = pytest.mark.e2e

Launch = Callable[..., GeserveProcess]


def _segments_of(pid: int) -> list[str]:
    return sorted(segments_of_server(pid))


def _server(launch: Launch, tmp_path: Path) -> tuple[GeserveProcess, list[int]]:
    repository = tmp_path / "models"
    copy_model("simple", repository)
    copy_model("simple_identity", repository)
    server = launch(f"--model-repository={repository}").wait_live()
    pid = server.process.pid
    assert _segments_of(pid), "segments carry the server's pid"
    assert len(worker_pids(server)) >= 2  # the workers and multiprocessing's resource tracker
    # Every process below the server: workers, resource tracker, and an engine and protocol processes if any.
    return server, descendants(pid)


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGBUS])
def test_workers_exit_and_segments_go_when_the_front_end_is_killed(launch: Launch, tmp_path: Path, signum: int) -> None:
    server, children = _server(launch, tmp_path)
    pid = server.process.pid
    os.kill(pid, signum)
    server.process.wait(timeout=30)
    assert wait_until(lambda: not any(alive(child) for child in children)), "workers outlived the front-end"
    assert wait_until(lambda: not _segments_of(pid)), _segments_of(pid)


@pytest.fixture
def private_shm() -> Iterator[tuple[tuple[str, ...], Path]]:
    """Where servers meet no other server's segments: a mount namespace with an empty /dev/shm of its own, held by a
    process the servers are entered into (their command prefix, and the folder their segments are seen in). Any
    server that starts sweeps what killed servers left, so in the shared /dev/shm another test's server (the suite
    runs files side by side) could sweep first. A host that cannot make a namespace uses the shared one."""
    script = "mount -t tmpfs -o size=256m tmpfs /dev/shm && echo ready && exec sleep 600"
    holder = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    ) if shutil.which("unshare") and shutil.which("nsenter") else None  # fmt: skip
    if holder is None or holder.stdout is None or holder.stdout.readline() != b"ready\n":
        if holder is not None:
            holder.kill()
            holder.wait()
        yield (), SHM_DIRECTORY
        return
    try:
        yield ("nsenter", f"--target={holder.pid}", "--mount"), Path(f"/proc/{holder.pid}/root/dev/shm")
    finally:
        holder.kill()
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()


def test_a_new_server_removes_what_a_server_killed_with_all_its_processes_left(
    tmp_path: Path, private_shm: tuple[tuple[str, ...], Path]
) -> None:
    """The OOM killer or a container stop kills the workers and the resource tracker too."""
    prefix, shm = private_shm
    repository = tmp_path / "models"
    copy_model("simple", repository)
    copy_model("simple_identity", repository)
    server = GeserveProcess(tmp_path / "first.log", f"--model-repository={repository}", prefix=prefix).wait_live()
    pid = server.process.pid
    children = descendants(pid)
    # Stopped first, all of them, so that no worker sees the front-end go and removes its arenas meanwhile.
    for signum in (signal.SIGSTOP, signal.SIGKILL):
        for process in (pid, *children):
            os.kill(process, signum)
    server.process.wait(timeout=30)
    server.stop()  # long dead: only its log is closed
    assert wait_until(lambda: not any(alive(child) for child in children))
    left = sorted(segments_of_server(pid, shm))
    assert left, "nothing was left to clean up: the test proves nothing"
    second = GeserveProcess(tmp_path / "second.log", f"--model-repository={repository}", prefix=prefix)
    try:
        second.wait_live()
        assert not segments_of_server(pid, shm), segments_of_server(pid, shm)
        removed = re.search(
            r"removed (\d+) shared-memory segment\(s\) left by geserve servers that were killed", second.log()
        )
        assert removed is not None and int(removed.group(1)) >= len(left), second.log()
    finally:
        assert second.stop() == 0, second.log()
