"""The supervisor: binds the ports, forks the engine and protocol processes, forwards shutdown, restarts."""

# The process the user started when --frontend-processes is 2 or more. It stops the server (exit 1) if the engine
# dies; the segments of the run never outlive it.

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import selectors
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from geserve.lifecycle import Deadlines, Ports, Role, ShutdownPlan, bind_ports, prepare_run
from geserve.multiprocess.child import run_child
from geserve.multiprocess.connection_count import create_counts, forget_listener
from geserve.multiprocess.control import DRAIN, KILL, PING, PONG, READY, REFUSE, STOP, Launch, send_word
from geserve.settings import Settings
from geserve.workers.runs import RunId, remove_run_segments
from geserve.workers.shm import REQUEST_ARENA_ROLE, SHM_DIRECTORY

logger = logging.getLogger(__name__)

_PR_SET_CHILD_SUBREAPER = 36
_TICK_S = 0.05
_RESTART_BACKOFF_S = (0.1, 0.5, 1.0, 2.0, 5.0)
_PING_S = 1.0  # between pings of a protocol process
_STABLE_S = 30.0  # a protocol process that ran this long restarts without delay
_DESCENDANTS_GRACE_S = 5.0  # for workers to notice their engine is gone before they are killed


@dataclass(slots=True)
class _Child:
    """One process the supervisor started, with its end of the control line."""

    role: Role
    index: int
    pid: int
    control: socket.socket
    started_at: float
    arena: str = ""  # a protocol process's request arena, removed once it is gone
    ready: bool = False
    exited: int | None = None
    unanswered_since: float | None = None  # when the ping not yet answered was sent
    next_ping: float = 0.0
    _buffer: bytes = b""

    @property
    def name(self) -> str:
        return "the engine" if self.role is Role.ENGINE else f"protocol process {self.index}"

    def words(self) -> list[bytes]:
        """The words the child sent since the last call (non-blocking)."""
        try:
            data = self.control.recv(4096)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            data = b""
        if not data:
            return [b""]
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        return [line.strip() for line in lines]


@dataclass(slots=True)
class _Restart:
    index: int
    at: float


@dataclass(slots=True)
class _State:
    signals: list[int] = field(default_factory=list)
    stopping: bool = False
    engine_stopped: bool = False
    deadlines: Deadlines | None = None  # of the shutdown a signal started
    refused: bool = False  # the engine was told REFUSE at the drain's end
    killed_stragglers: bool = False  # protocol processes still running at the deadline were killed
    restarts: dict[int, int] = field(default_factory=dict)  # index -> consecutive quick deaths
    pending: list[_Restart] = field(default_factory=list)


class Supervisor:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.run = RunId.current()
        self.processes = settings.server.frontend_processes
        self._sockets: list[socket.socket] = []
        self._ports = Ports()
        self._channel_dir = Path(tempfile.mkdtemp(prefix="geserve-engine-"))
        self._channel_path = str(self._channel_dir / "engine.sock")
        self._selector = selectors.DefaultSelector()
        self._engine: _Child | None = None
        self._protocols: dict[int, _Child] = {}
        self._state = _State()
        self._connection_counts: mmap.mmap | None = None
        self._announced = False

    # -- the run ---------------------------------------------------------------------------

    def serve(self) -> int:
        try:
            return self._serve()
        finally:
            self._cleanup()

    def _serve(self) -> int:
        _become_subreaper()
        prepare_run(self.settings)
        ports = bind_ports(self.settings, check_grpc=True)
        if ports is None:
            return 1
        self._ports = ports
        if self.settings.http.enabled:
            self._connection_counts = create_counts(self.processes)
        wakeup_read, wakeup_write = socket.socketpair()
        wakeup_read.setblocking(False)
        wakeup_write.setblocking(False)
        self._sockets += [wakeup_read, wakeup_write]
        signal.set_wakeup_fd(wakeup_write.fileno(), warn_on_full_buffer=False)
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._on_signal)
        self._selector.register(wakeup_read, selectors.EVENT_READ, None)
        self._engine = self._start(Role.ENGINE, 0)
        _close(self._ports.metrics)  # the engine alone serves it, and never restarts
        self._ports.metrics = None
        for index in range(self.processes):
            self._protocols[index] = self._start(Role.PROTOCOL, index)
        while True:
            status = self._step(wakeup_read)
            if status is not None:
                return status

    def _step(self, wakeup: socket.socket) -> int | None:
        """One turn: read what children said, handle signals, reap, restart; an exit status when done."""
        for key, _ in self._selector.select(_TICK_S):
            if key.data is None:
                with contextlib.suppress(OSError):
                    wakeup.recv(4096)
            else:
                self._heard(key.data)
        if self._state.signals:
            if self._state.stopping:
                logger.warning("second signal: exiting without draining")
                self._kill_all()
                return 1
            self._state.signals.clear()
            self._begin_shutdown()
        status = self._reap()
        if status is not None:
            return status
        self._restart_due()
        self._ping_protocols()
        deadlines, now = self._state.deadlines, time.monotonic()
        if deadlines is not None and not self._state.refused and now >= deadlines.refuse_at:
            # As in one process: what is admitted finishes, what arrives now is refused (streams included).
            self._state.refused = True
            if self._engine is not None:
                send_word(self._engine.control, REFUSE)
        if deadlines is not None and not self._state.killed_stragglers and now > deadlines.kill_by:
            self._state.killed_stragglers = True
            for child in self._protocols.values():
                if child.exited is None:
                    logger.warning("%s did not finish in time: killing it", child.name)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(child.pid, signal.SIGKILL)
        return None

    def _on_signal(self, signum: int, frame: object) -> None:
        self._state.signals.append(signum)

    def _heard(self, child: _Child) -> None:
        for word in child.words():
            if word == READY and not child.ready:
                child.ready = True
                if child.role is Role.ENGINE:
                    logger.info("the engine (pid %d) is serving", child.pid)
                elif not self._announced and all(other.ready for other in self._protocols.values()):
                    self._announce()
            elif word == PONG:
                child.unanswered_since = None
            elif word == b"":
                self._selector.unregister(child.control)
                break

    def _ping_protocols(self) -> None:
        """Ping each serving protocol process once a second; one whose event loop has not answered within
        --protocol-healthcheck-secs is stuck (a request that blocks its loop, a deadlock) and is killed, to be
        replaced like any protocol process that dies."""
        timeout_s = self.settings.server.protocol_healthcheck_secs
        if not timeout_s or self._state.stopping:
            return
        now = time.monotonic()
        for child in self._protocols.values():
            if not child.ready or child.exited is not None:
                continue
            if child.unanswered_since is not None and now - child.unanswered_since > timeout_s:
                logger.error(
                    "%s (pid %d) has not answered for %g s: its event loop is stuck; killing it",
                    child.name,
                    child.pid,
                    timeout_s,
                )
                child.unanswered_since = None
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signal.SIGKILL)
            elif child.unanswered_since is None and now >= child.next_ping:
                child.unanswered_since = now
                child.next_ping = now + _PING_S
                send_word(child.control, PING)

    def _announce(self) -> None:
        """One line per service once every protocol process listens, as a single process says it."""
        self._announced = True
        settings, count = self.settings, len(self._protocols)
        if settings.grpc.enabled:
            address = settings.grpc.address
            logger.info(
                "Started GRPCInferenceService at %s:%d (%d protocol processes)", address, settings.grpc.port, count
            )
        if settings.http.enabled:
            # The port the supervisor bound (a --http-port of 0 picks one).
            http = self._ports.http
            port = http.getsockname()[1] if http is not None else settings.http.port
            logger.info("Started HTTPService at %s:%d (%d protocol processes)", settings.http.address, port, count)

    def _begin_shutdown(self) -> None:
        """Not ready everywhere at once (the engine answers readiness), the drain window, then stop accepting."""
        self._state.stopping = True
        self._state.pending.clear()
        # No protocol process starts again: the listening socket must close when the last of them closes
        # theirs, so that connections are refused, not queued where no one will accept them.
        _close(self._ports.http)
        self._ports.http = None
        plan = ShutdownPlan.of(self.settings.server)
        self._state.deadlines = plan.begin()
        logger.info("shutting down: draining for %gs", plan.drain_s)
        if self._engine is not None:
            send_word(self._engine.control, DRAIN)
        for child in self._protocols.values():
            send_word(child.control, DRAIN)
        self._stop_engine_when_alone()

    def _stop_engine_when_alone(self) -> None:
        if self._engine is None or self._state.engine_stopped:
            return
        if all(child.exited is not None for child in self._protocols.values()):
            self._state.engine_stopped = True
            send_word(self._engine.control, STOP)

    # -- children --------------------------------------------------------------------------

    def _start(self, role: Role, index: int) -> _Child:
        ours, theirs = socket.socketpair()
        metrics, http = self._ports.metrics, self._ports.http
        metrics_fd = metrics.fileno() if role is Role.ENGINE and metrics is not None else -1
        http_fd = http.fileno() if role is Role.PROTOCOL and http is not None else -1
        arena = self.run.segment_name(f"{REQUEST_ARENA_ROLE}{index}") if role is Role.PROTOCOL else ""
        launch = Launch(
            role,
            self.settings,
            self.run,
            self._channel_path,
            index,
            http_fd,
            metrics_fd,
            self._connection_counts,
            arena,
        )
        # Forked, not executed: everything is imported already, so a process starts (or restarts) in
        # milliseconds. The supervisor has no thread and no event loop to carry over.
        pid = os.fork()
        if pid == 0:
            keep = {theirs.fileno(), http_fd, metrics_fd}
            self._selector.close()
            for sock in [ours, *self._sockets, self._ports.http, self._ports.metrics]:
                if sock is not None and sock.fileno() not in keep:
                    sock.close()
            for child in [self._engine, *self._protocols.values()]:
                if child is not None:
                    child.control.close()
            os._exit(run_child(launch, theirs))
        theirs.close()
        ours.setblocking(False)
        child = _Child(role, index, pid, ours, time.monotonic(), arena)
        self._selector.register(ours, selectors.EVENT_READ, child)
        if role is Role.ENGINE:
            logger.info("started the engine (pid %d)", pid)
        else:
            logger.info("started protocol process %d (pid %d)", index, pid)
        return child

    def _reap(self) -> int | None:
        """Collect every child that exited (reparented workers included); an exit status when the server ends."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return None
            if pid == 0:
                return None
            code = os.waitstatus_to_exitcode(status)
            child = self._child(pid)
            if child is None:
                continue  # a worker of the engine, reparented here when the engine went
            child.exited = code
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(child.control)
            child.control.close()
            if child.role is Role.ENGINE:
                if self._state.engine_stopped:
                    return code
                logger.error("the engine (pid %d) exited with status %d; stopping the server", pid, code)
                self._kill_all()
                return 1
            status_of_server = self._protocol_exited(child, code)
            if status_of_server is not None:
                return status_of_server

    def _protocol_exited(self, child: _Child, code: int) -> int | None:
        # Its arena goes with it (a process killed outright cannot remove it); the engine unmaps it when it
        # sees the connection close.
        if child.arena:
            with contextlib.suppress(FileNotFoundError):
                (SHM_DIRECTORY / child.arena).unlink()
        if self._connection_counts is not None:
            forget_listener(self._connection_counts, child.index)  # its copy of the socket closed as it died
        if self._state.stopping:
            self._stop_engine_when_alone()
            return None
        if not child.ready:
            logger.error(
                "%s (pid %d) exited with status %d during startup; stopping the server",
                child.name,
                child.pid,
                code,
            )
            self._kill_all()
            return 1
        logger.warning("%s (pid %d) exited with status %d; restarting", child.name, child.pid, code)
        quick = time.monotonic() - child.started_at < _STABLE_S
        deaths = self._state.restarts.get(child.index, 0) + 1 if quick else 0
        self._state.restarts[child.index] = deaths
        delay = _RESTART_BACKOFF_S[min(deaths, len(_RESTART_BACKOFF_S)) - 1] if deaths else 0.0
        self._state.pending.append(_Restart(child.index, time.monotonic() + delay))
        return None

    def _restart_due(self) -> None:
        now = time.monotonic()
        due = [restart for restart in self._state.pending if restart.at <= now]
        for restart in due:
            self._state.pending.remove(restart)
            self._protocols[restart.index] = self._start(Role.PROTOCOL, restart.index)

    def _child(self, pid: int) -> _Child | None:
        if self._engine is not None and self._engine.pid == pid:
            return self._engine
        for child in self._protocols.values():
            if child.pid == pid and child.exited is None:
                return child
        return None

    def _kill_all(self) -> None:
        """Kill the protocol processes and tell the engine to kill its workers and exit at once."""
        for child in self._protocols.values():
            if child.exited is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signal.SIGKILL)
        if self._engine is not None and self._engine.exited is None:
            send_word(self._engine.control, KILL)

    # -- cleanup -----------------------------------------------------------------------------

    def _cleanup(self) -> None:
        """Wait for every process of the run (workers reparented here too), then remove what they left."""
        deadline = time.monotonic() + _DESCENDANTS_GRACE_S
        while time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                time.sleep(_TICK_S)
        for pid in _children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, 0)[0]:
                pass
        removed = remove_run_segments(self.run)
        if removed:
            logger.warning("removed %d shared-memory segment(s) the engine's processes left", len(removed))
        for sock in self._sockets:
            sock.close()
        self._ports.close()
        shutil.rmtree(self._channel_dir, ignore_errors=True)


def _close(sock: socket.socket | None) -> None:
    if sock is not None:
        sock.close()


def _become_subreaper() -> None:
    """Orphaned descendants (the workers of an engine that died) become this process's children, to be reaped."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            logger.debug("cannot become a child subreaper: %s", errno.errorcode.get(ctypes.get_errno(), "?"))


def _children() -> list[int]:
    pids: list[int] = []
    for task in Path("/proc/self/task").glob("*/children"):
        with contextlib.suppress(OSError):
            pids += [int(pid) for pid in task.read_text().split()]
    return pids
