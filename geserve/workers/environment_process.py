"""EnvironmentProcess: a spawned worker that runs another interpreter (a model's execution environment)."""

from __future__ import annotations

import io
import os
from multiprocessing import popen_spawn_posix, reduction, spawn, util
from multiprocessing.context import SpawnProcess, set_spawning_popen
from multiprocessing.process import BaseProcess
from typing import Any


class EnvironmentProcess(SpawnProcess):
    """A `spawn` process started with `interpreter` instead of the server's, whose search path is `search_path`
    instead of a copy of the server's. The interpreter is chosen per process: multiprocessing's own
    `set_executable` is one setting for every process the server starts."""

    def __init__(self, interpreter: str, search_path: tuple[str, ...], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.interpreter = interpreter
        self.search_path = search_path

    @staticmethod
    def _Popen(process_obj: BaseProcess) -> _EnvironmentPopen:  # noqa: N802
        return _EnvironmentPopen(process_obj)


def preparation_data(name: str, search_path: tuple[str, ...]) -> dict[str, Any]:
    """spawn's preparation data, with the environment's search path and without the server's main module: the
    worker's target lives in geserve, and the server's main (a console script, say) would import the server's
    packages into the environment before the model's."""
    data = spawn.get_preparation_data(name)
    data["sys_path"] = list(search_path)
    data.pop("init_main_from_name", None)
    data.pop("init_main_from_path", None)
    return data


class _EnvironmentPopen(popen_spawn_posix.Popen):
    """spawn's launch with the process's interpreter and preparation data; the rest is multiprocessing's."""

    def _launch(self, process_obj: BaseProcess) -> None:
        from multiprocessing import resource_tracker

        assert isinstance(process_obj, EnvironmentProcess)
        fds: list[int] = self._fds  # type: ignore[attr-defined]
        tracker_fd = resource_tracker.getfd()  # started if it was not: never None after this call
        assert tracker_fd is not None
        fds.append(tracker_fd)
        prepared = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(preparation_data(process_obj.name, process_obj.search_path), prepared)
            reduction.dump(process_obj, prepared)
        finally:
            set_spawning_popen(None)
        parent_r = child_w = child_r = parent_w = None
        try:
            parent_r, child_w = os.pipe()
            child_r, parent_w = os.pipe()
            # As multiprocessing's own executable setting, the interpreter is given as bytes.
            interpreter = os.fsencode(process_obj.interpreter)
            arguments = [str(part) for part in spawn.get_command_line(tracker_fd=tracker_fd, pipe_handle=child_r)[1:]]
            fds.extend([child_r, child_w])
            self.pid = util.spawnv_passfds(interpreter, [interpreter, *arguments], fds)
            self.sentinel = parent_r
            with open(parent_w, "wb", closefd=False) as pipe:
                pipe.write(prepared.getbuffer())
        finally:
            unused = [fd for fd in (parent_r, parent_w) if fd is not None]
            self.finalizer = util.Finalize(self, util.close_fds, unused)  # type: ignore[attr-defined]
            for fd in (child_r, child_w):
                if fd is not None:
                    os.close(fd)
