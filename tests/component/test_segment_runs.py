"""A segment made by a process the server did not start itself is the server's: named for its run, swept with it."""

from __future__ import annotations

import multiprocessing
import os
import time
from multiprocessing import resource_tracker
from multiprocessing.queues import Queue

from geserve.workers.runs import RunId, run_of, sweep_orphaned_segments
from geserve.workers.shm import SHM_DIRECTORY, create_segment, unlink_quietly

CONTEXT = multiprocessing.get_context("spawn")


def _server(reports: Queue[object]) -> None:
    """The top of a run, as geserve's front-end is: it makes the run id and hands it to the process it starts."""
    run = RunId.current()
    reports.put(run)
    worker = CONTEXT.Process(target=_worker, args=(run, reports))
    worker.start()
    worker.join()
    time.sleep(120)  # running, until the test kills it


def _worker(run: RunId, reports: Queue[object]) -> None:
    grandchild = CONTEXT.Process(target=_grandchild, args=(run, reports))
    grandchild.start()
    grandchild.join()


def _grandchild(run: RunId, reports: Queue[object]) -> None:
    segment = create_segment(run.segment_name("grandchild"), 64)
    # Left behind on purpose, as by a run killed together with the resource tracker that would remove it.
    resource_tracker.unregister(f"/{segment.name}", "shared_memory")
    segment.close()
    reports.put((segment.name, os.getppid()))


def test_a_grandchild_names_its_segment_for_the_server_run_which_the_sweep_removes_once_the_run_is_gone() -> None:
    reports: Queue[object] = CONTEXT.Queue()
    server = CONTEXT.Process(target=_server, args=(reports,))  # not a daemon: daemons may not start processes
    server.start()
    name = ""
    try:
        run = reports.get(timeout=60)
        name, parent = reports.get(timeout=60)
        assert isinstance(run, RunId) and run.pid == server.pid
        assert parent not in (server.pid, os.getpid())  # not a child of the server: its child's child
        assert run_of(name) == run and name.startswith(run.prefix)
        assert name not in sweep_orphaned_segments(), "a live run's segment was swept"
        assert (SHM_DIRECTORY / name).exists()
        server.kill()
        server.join(30)
        assert name in sweep_orphaned_segments()
        assert not (SHM_DIRECTORY / name).exists()
    finally:
        if server.is_alive():
            server.kill()
        if name:
            unlink_quietly(name)
        reports.close()
