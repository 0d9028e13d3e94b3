"""AbandonableExecutor: a thread pool whose calls a process may leave unfinished when it exits."""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

_Work = tuple[Future[Any], Callable[[], Any]]


class AbandonableExecutor(Executor):
    """Runs calls on up to `threads` daemon threads, started as calls come.

    concurrent.futures.ThreadPoolExecutor joins its threads when the interpreter exits, even after
    `shutdown(wait=False)`: one call hung in a network read (an object store that accepts connections and never
    answers) then holds the whole process for that call's timeouts after SIGTERM. These threads are daemons: a call
    still running at exit is abandoned with the process. Use it only for calls whose half-done work nobody needs
    (reads, and writes into folders that are removed anyway)."""

    def __init__(self, threads: int, thread_name_prefix: str) -> None:
        self._threads = threads
        self._prefix = thread_name_prefix
        self._started: list[threading.Thread] = []
        self._idle = threading.Semaphore(0)  # threads waiting for work
        self._work: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._shut = False
        self._numbers = itertools.count()

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            if self._shut:
                raise RuntimeError("cannot schedule new calls after shutdown")
            self._work.put((future, lambda: fn(*args, **kwargs)))
            if not self._idle.acquire(blocking=False) and len(self._started) < self._threads:
                thread = threading.Thread(target=self._serve, name=f"{self._prefix}_{next(self._numbers)}", daemon=True)
                self._started.append(thread)
                thread.start()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._shut = True
            if cancel_futures:
                while True:
                    try:
                        work = self._work.get_nowait()
                    except queue.Empty:
                        break
                    if work is not None:
                        work[0].cancel()
            for _ in self._started:
                self._work.put(None)  # one for each thread: each ends after the calls before it
            threads = list(self._started)
        if wait:
            for thread in threads:
                thread.join()

    def _serve(self) -> None:
        while True:
            work = self._work.get()
            if work is None:
                return
            future, call = work
            if future.set_running_or_notify_cancel():
                try:
                    result = call()
                except BaseException as error:  # handed to whoever waits on the future, as ThreadPoolExecutor does
                    future.set_exception(error)
                else:
                    future.set_result(result)
            del work, future, call  # nothing of a finished call stays alive while this thread waits
            self._idle.release()
