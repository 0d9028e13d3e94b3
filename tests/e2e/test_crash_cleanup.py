"""A front-end killed outright: its workers (and, under a supervisor, its engine and protocol processes) exit, and
no shared-memory segment of it survives."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

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


def test_a_new_server_removes_what_a_server_killed_with_all_its_processes_left(launch: Launch, tmp_path: Path) -> None:
    """The OOM killer or a container stop kills the workers and the resource tracker too."""
    server, children = _server(launch, tmp_path / "first")
    pid = server.process.pid
    # Stopped first, all of them, so that no worker sees the front-end go and removes its arenas meanwhile.
    for signum in (signal.SIGSTOP, signal.SIGKILL):
        for process in (pid, *children):
            os.kill(process, signum)
    server.process.wait(timeout=30)
    assert wait_until(lambda: not any(alive(child) for child in children))
    left = _segments_of(pid)
    assert left, "nothing was left to clean up: the test proves nothing"
    second = launch(f"--model-repository={tmp_path / 'first' / 'models'}").wait_live()
    assert not _segments_of(pid), _segments_of(pid)
    removed = re.search(
        r"removed (\d+) shared-memory segment\(s\) left by geserve servers that were killed", second.log()
    )
    assert removed is not None and int(removed.group(1)) >= len(left), second.log()
    assert second.stop() == 0
