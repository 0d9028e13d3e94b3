"""AbandonableExecutor: results and errors as a thread pool gives them, its thread bound, and an exit that leaves a
hung call behind."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent.futures import CancelledError

import pytest

from geserve.abandonable import AbandonableExecutor


def test_results_and_errors_reach_their_futures() -> None:
    executor = AbandonableExecutor(2, thread_name_prefix="test")
    assert executor.submit(lambda a, b: a + b, 2, b=3).result(timeout=5) == 5
    failing = executor.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failing.result(timeout=5)
    assert list(executor.map(str, range(4))) == ["0", "1", "2", "3"]
    executor.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        executor.submit(print)


def test_no_more_threads_than_asked_and_idle_ones_are_reused() -> None:
    executor = AbandonableExecutor(2, thread_name_prefix="bounded")
    gate = threading.Event()
    names: set[str] = set()

    def wait() -> None:
        names.add(threading.current_thread().name)
        gate.wait(10)

    futures = [executor.submit(wait) for _ in range(6)]
    time.sleep(0.2)
    assert sum(future.running() for future in futures) == 2  # the rest wait their turn
    gate.set()
    for future in futures:
        future.result(timeout=5)
    for _ in range(10):  # one call at a time: the idle thread takes each, none is added
        executor.submit(names.add, "x").result(timeout=5)
    executor.shutdown()
    assert {name for name in names if name != "x"} <= {"bounded_0", "bounded_1"}


def test_shutdown_cancels_what_has_not_started() -> None:
    executor = AbandonableExecutor(1, thread_name_prefix="cancel")
    gate = threading.Event()
    running = executor.submit(gate.wait, 10)
    waiting = executor.submit(print, "never")
    time.sleep(0.1)
    executor.shutdown(wait=False, cancel_futures=True)
    with pytest.raises(CancelledError):
        waiting.result(timeout=5)
    gate.set()
    assert running.result(timeout=5) is True


def test_a_process_exits_without_waiting_for_a_hung_call() -> None:
    # A ThreadPoolExecutor's thread, hung the same way, holds the interpreter's exit for the call's whole 60 s.
    program = (
        "import threading\n"
        "from geserve.abandonable import AbandonableExecutor\n"
        "executor = AbandonableExecutor(1, thread_name_prefix='hung')\n"
        "executor.submit(threading.Event().wait, 60)\n"
        "executor.shutdown(wait=False, cancel_futures=True)\n"
    )
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", program], check=True, timeout=30)
    assert time.monotonic() - started < 10
