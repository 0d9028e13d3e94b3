"""A worker's ties to its parent: group signals are the parent's, and the worker exits once the parent is gone."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing import resource_tracker
from multiprocessing.process import BaseProcess

logger = logging.getLogger(__name__)

# How often the parent is looked for: an orphan outlives its server by about this much.
PARENT_POLL_S = 0.2
# What Ctrl-C, systemd (KillMode=control-group) and `tini -g` send to every process of the group at once.
GROUP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})


def start_shielded(process: BaseProcess) -> None:
    """Start `process` with the group's signals blocked: a spawned worker imports for a while before its
    `run_worker` can ignore them, and a signal to the group meanwhile would kill it as it starts. The mask is
    inherited through fork and exec (CPython's resource tracker starts its process the same way); the worker
    unblocks them once ignored. Only the calling thread's mask changes: the main thread still takes the signal."""
    # The tracker's first start unblocks both signals in this thread when it is done (CPython 3.11's
    # resource_tracker.ensure_running): started first, it leaves the mask below alone.
    resource_tracker.ensure_running()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, GROUP_SIGNALS)
    try:
        process.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def watch_parent(on_gone: Callable[[], None], poll_s: float = PARENT_POLL_S) -> threading.Thread | None:
    """Call `on_gone`, then exit the process, once its parent has exited (None when this process was not started
    by multiprocessing: nothing to watch).

    The pipe to the front-end closing says the same, but only to a worker that reads it: one inside a model's
    execute that never returns reads nothing, and a front-end killed while its shutdown waits on that model would
    leave it running. A thread of its own sees the parent go whatever the main thread does. Not PR_SET_PDEATHSIG:
    it follows the thread that forked (here the front-end's spawner thread, not the process), and a signal that
    kills at once would leave the arenas to the next server's sweep; Triton's python backend stub likewise polls
    for its parent (`ParentProcessHealthCheck`)."""
    parent = multiprocessing.parent_process()
    if parent is None or parent.pid is None:
        return None
    parent_pid = parent.pid

    def watch() -> None:
        # Reparented (to init, or to a supervisor that reaps orphans): the parent is gone.
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        logger.warning("the server (pid %d) is gone: exiting", parent_pid)
        try:
            on_gone()
        finally:
            os._exit(1)

    thread = threading.Thread(target=watch, name="geserve-parent-watch", daemon=True)
    thread.start()
    return thread
