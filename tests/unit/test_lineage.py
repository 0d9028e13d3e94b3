"""A worker's ties to its parent: started with the process group's signals blocked; one stop timeout in all."""

from __future__ import annotations

import asyncio
import multiprocessing
import signal
import warnings
from multiprocessing.connection import Connection

from geserve.batching.lifecycle import InstanceLifecycle
from geserve.lifecycle import STOP_FLOOR_S
from geserve.types import InstanceStatus
from geserve.workers.lineage import GROUP_SIGNALS, start_shielded


def _report_mask(connection: Connection) -> None:
    """The signals blocked as the process's target begins (spawned: it ran a whole interpreter's start first)."""
    connection.send(sorted(int(signum) for signum in signal.pthread_sigmask(signal.SIG_BLOCK, [])))
    connection.close()


def test_a_worker_starts_with_the_group_signals_blocked_and_its_parent_keeps_its_own_mask() -> None:
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe(duplex=False)
    process = context.Process(target=_report_mask, args=(theirs,))
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    with warnings.catch_warnings():
        # An earlier test may have ended this process's tracker: starting it again is what is under test too.
        warnings.filterwarnings("ignore", "resource_tracker: process died unexpectedly", UserWarning)
        start_shielded(process)
    theirs.close()
    try:
        assert ours.poll(60)
        blocked = set(ours.recv())
    finally:
        process.join(30)
    assert {int(signum) for signum in GROUP_SIGNALS} <= blocked
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before


class _StuckScheduler:
    async def drain(self) -> None:
        await asyncio.Event().wait()  # a batch that never comes back


class _Pool:
    def __init__(self) -> None:
        self.stop_timeouts: list[float] = []

    def ready(self) -> bool:
        return True

    async def read_statuses(self) -> list[InstanceStatus]:
        return []

    async def stop(self, timeout_s: float) -> None:
        self.stop_timeouts.append(timeout_s)

    def kill(self) -> None:
        pass


def test_a_drain_that_spends_the_timeout_leaves_the_workers_only_the_floor() -> None:
    pool = _Pool()
    lifecycle = InstanceLifecycle("stuck", pool, _StuckScheduler())
    asyncio.run(lifecycle.stop(0.2))
    assert pool.stop_timeouts == [STOP_FLOOR_S]  # not another 0.2 s (or, with --exit-timeout-secs, another 30 s)
