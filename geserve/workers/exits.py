"""One exit watcher per worker process: reaped once, off the event loop, and its handles closed."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing


def watch_exit(process: multiprocessing.process.BaseProcess) -> asyncio.Future[None]:
    """A future done once the process has exited and been reaped.

    Exactly one waiter reaps each process: of two threads in waitpid() on one child, the loser gets
    ECHILD, which multiprocessing reports as "still running" (and stop() then killed a worker that had
    already exited cleanly). The sentinel becomes readable as the process exits, so no thread waits
    on a live worker.
    """
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[None] = loop.create_future()
    sentinel = process.sentinel

    def on_sentinel() -> None:
        loop.remove_reader(sentinel)
        # The exit status follows the sentinel by a moment; the blocking waitpid runs off the loop.
        reaped = loop.run_in_executor(None, _join, process)
        reaped.add_done_callback(lambda _: None if exited.done() else exited.set_result(None))

    loop.add_reader(sentinel, on_sentinel)
    return exited


async def wait_exit(exited: asyncio.Future[None], timeout_s: float) -> bool:
    """Whether the process exited within the timeout; the watch itself goes on either way."""
    try:
        await asyncio.wait_for(asyncio.shield(exited), timeout_s)
    except TimeoutError:
        return False
    return True


def _join(process: multiprocessing.process.BaseProcess) -> None:
    with contextlib.suppress(ValueError):  # closed: already reaped
        process.join()


def is_alive(process: multiprocessing.process.BaseProcess) -> bool:
    try:
        return process.is_alive()
    except ValueError:  # closed: it exited and was reaped
        return False


def pid_of(process: multiprocessing.process.BaseProcess | None) -> int | None:
    try:
        return process.pid if process is not None else None
    except ValueError:
        return None


def close_exited(process: multiprocessing.process.BaseProcess, exited: asyncio.Future[None]) -> None:
    """Release the process object's pipe (its sentinel) once it has exited; the garbage collector
    would, but only now and then, so a model reloaded in a loop held ever more of them."""
    if not exited.done():
        return  # the exit watch still has the sentinel registered on the loop
    with contextlib.suppress(ValueError):  # still running: the object keeps its pipe until reaped
        process.close()
