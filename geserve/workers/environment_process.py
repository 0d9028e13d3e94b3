"""EnvironmentProcess: a spawned worker that runs another interpreter (a model's execution environment)."""

from __future__ import annotations

import io
import os
import subprocess
from collections.abc import Mapping
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


def command_line(interpreter: str, tracker_fd: int, pipe_handle: int) -> list[str]:
    """spawn's command line for `interpreter`, with -E -s instead of the server's interpreter flags: the server's
    PYTHONPATH, PYTHONHOME and user site-packages are not the environment's (its search path was probed with -E -s,
    and geserve reaches the worker through the search path in the preparation data)."""
    server = spawn.get_command_line(tracker_fd=tracker_fd, pipe_handle=pipe_handle)
    return [interpreter, "-E", "-s", *(str(part) for part in server[server.index("-c") :])]


def launch_environment(interpreter: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables the environment's interpreter starts with: the server's, LD_LIBRARY_PATH led by the
    environment's lib folder (as Triton's stub launcher sets it), so that its interpreter and extensions find the
    environment's shared libraries first. The loader reads it as the process starts: it cannot be set later."""
    library = os.path.join(os.path.dirname(os.path.dirname(interpreter)), "lib")  # <env>/bin/python3 -> <env>/lib
    existing = environ.get("LD_LIBRARY_PATH", "")
    return {**environ, "LD_LIBRARY_PATH": f"{library}{os.pathsep}{existing}" if existing else library}


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
            interpreter = process_obj.interpreter
            fds.extend([child_r, child_w])
            child = subprocess.Popen(
                command_line(interpreter, tracker_fd, child_r),
                executable=interpreter,
                pass_fds=sorted(set(fds)),
                env=launch_environment(interpreter, os.environ),
            )
            # multiprocessing waits for this process by its pid (exits.watch_exit reaps it): marked done, the
            # subprocess object never waits for it too, which would take the exit status from multiprocessing.
            child.returncode = 0
            self.pid = child.pid
            self.sentinel = parent_r
            with open(parent_w, "wb", closefd=False) as pipe:
                pipe.write(prepared.getbuffer())
        finally:
            unused = [fd for fd in (parent_r, parent_w) if fd is not None]
            self.finalizer = util.Finalize(self, util.close_fds, unused)  # type: ignore[attr-defined]
            for fd in (child_r, child_w):
                if fd is not None:
                    os.close(fd)
