"""ProcessSupervisor: spawns an instance's worker process, reaps it, and restarts it under a RestartPolicy."""

from __future__ import annotations

import asyncio
import collections
import logging
import multiprocessing
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from geserve.errors import UnavailableError
from geserve.workers import main as worker_main
from geserve.workers.channel import BlsHandler, Lifecycle, WorkerChannel
from geserve.workers.client import InstanceState
from geserve.workers.environment_process import EnvironmentProcess
from geserve.workers.exits import close_exited, is_alive, pid_of, wait_exit, watch_exit
from geserve.workers.lineage import start_shielded
from geserve.workers.messages import InstanceSpec, Loaded, LoadFailed, Retiring

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """Backoff between restarts, and when a crash loop makes the instance give up."""

    first_delay_s: float = 0.5
    max_delay_s: float = 10.0
    max_crashes: int = 5
    crash_window_s: float = 60.0

    def delay(self, attempt: int) -> float:
        return float(min(self.first_delay_s * 2.0**attempt, self.max_delay_s))


# Start a fresh process: None once it is up, else why it could not load.
Respawn = Callable[[], Awaitable[str | None]]


class Restarts:
    """Counts an instance's crashes and runs its restarts with backoff, or gives up on a crash loop.
    `crashed` answers whether a restart is on its way; `on_up` and `on_give_up` report how it ended."""

    def __init__(
        self,
        name: str,
        policy: RestartPolicy,
        respawn: Respawn,
        on_up: Callable[[], None],
        on_give_up: Callable[[str], None],
    ) -> None:
        self._name = name
        self._policy = policy
        self._respawn = respawn
        self._on_up = on_up
        self._on_give_up = on_give_up
        self._crashes: collections.deque[float] = collections.deque()
        self._task: asyncio.Task[None] | None = None

    def crashed(self, reason: str) -> bool:
        """Record a crash; restart in the background unless the instance keeps crashing (then give up)."""
        now = time.monotonic()
        self._crashes.append(now)
        while self._crashes and now - self._crashes[0] > self._policy.crash_window_s:
            self._crashes.popleft()
        if len(self._crashes) >= self._policy.max_crashes:
            self._give_up(f"{reason}; it crashed {len(self._crashes)} times within {self._policy.crash_window_s:.0f}s")
            return False
        self._task = asyncio.get_running_loop().create_task(self._restart())
        return True

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def _give_up(self, reason: str) -> None:
        logger.error("giving up on instance %s: %s", self._name, reason)
        self._on_give_up(reason)

    async def _restart(self) -> None:
        attempt = len(self._crashes) - 1
        while True:
            await asyncio.sleep(self._policy.delay(attempt))
            failure = await self._respawn()
            if failure is None:
                self._on_up()
                return
            attempt += 1
            if attempt >= self._policy.max_crashes:
                self._give_up(f"restart failed: {failure}")
                return


class ProcessSupervisor:
    """The life of one instance's worker process: spawn it and wait until it loaded, reap it when it dies
    (failing what its channel still waits for with the reason), restart it under the policy or give up, stop
    or kill it. Each process is reached through a WorkerChannel of its own (`channel`); `on_up` is called when
    a restarted process is ready."""

    def __init__(
        self,
        spec: InstanceSpec,
        policy: RestartPolicy,
        serve_bls: BlsHandler,
        on_up: Callable[[], None],
        renew: Callable[[InstanceSpec], InstanceSpec] | None = None,
    ) -> None:
        self._spec = spec
        self._renew = renew  # the spec a restarted process gets (its own output arena)
        self._serve_bls = serve_bls
        self._on_up = on_up
        self._restarts = Restarts(spec.instance_name, policy, self._respawn, self._back_up, self._give_up)
        self._context = multiprocessing.get_context("spawn")
        # Starting a spawned interpreter blocks; it happens on this thread, off the event loop.
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix=f"geserve-spawn-{spec.instance_name}")
        self._state = InstanceState.STARTING
        self.reason = ""  # why the instance is not ready (it died, or gave up)
        self.incarnation = 0  # how many processes have served the instance
        self._process: multiprocessing.process.BaseProcess | None = None
        self._exited: asyncio.Future[None] | None = None  # the current process's exit, reaped once
        self._channel: WorkerChannel | None = None
        self._started: asyncio.Future[Loaded | LoadFailed] | None = None
        self._retiring = ""  # why the worker said it is exiting on purpose
        self._reaping: set[asyncio.Task[None]] = set()

    @property
    def state(self) -> InstanceState:
        return self._state

    @property
    def alive(self) -> bool:
        """Ready, and its connection has not ended (the exit may not be reaped yet)."""
        return self._state is InstanceState.READY and self._channel is not None and self._channel.open

    @property
    def channel(self) -> WorkerChannel | None:
        """The connection to the current process (None before the first spawn)."""
        return self._channel

    @property
    def process(self) -> multiprocessing.process.BaseProcess | None:
        return self._process

    @property
    def pid(self) -> int | None:
        return pid_of(self._process)

    def exited_message(self) -> str:
        """Why the instance takes no batch now."""
        if self._state is InstanceState.READY and not self.alive:
            return f"{self._instance()} exited unexpectedly"
        reason = f" ({self.reason})" if self.reason else ""
        return f"{self._instance()} is {self._state.value}{reason}"

    def _instance(self) -> str:
        spec = self._spec
        return f"instance '{spec.instance_name}' of model '{spec.model_name}' version {spec.model_version}"

    # -- start and stop ---------------------------------------------------------------------------

    async def start(self, spec: InstanceSpec) -> Loaded | LoadFailed:
        """Spawn the first process of `spec` (its arenas named) and wait until it loaded; raises OSError when it
        cannot be started."""
        self._spec = spec
        result = await self._spawn()
        if isinstance(result, Loaded):
            self._state = InstanceState.READY
        return result

    async def _spawn(self) -> Loaded | LoadFailed:
        loop = asyncio.get_running_loop()
        self.incarnation += 1
        parent, child = self._context.Pipe(duplex=True)
        options: dict[str, Any] = {
            "target": worker_main.run_worker,
            "args": (child, self._spec),
            "name": f"geserve-worker-{self._spec.instance_name}",
            "daemon": True,
        }
        process: multiprocessing.process.BaseProcess
        if self._spec.interpreter:
            process = EnvironmentProcess(self._spec.interpreter, self._spec.search_path, **options)
        else:
            process = self._context.Process(**options)
        self._started = loop.create_future()
        await loop.run_in_executor(self._spawner, start_shielded, process)
        child.close()
        self._process = process
        self._exited = exited = watch_exit(process)
        self._channel = WorkerChannel(
            parent,
            self._spec.instance_name,
            self._serve_bls,
            on_lifecycle=self._on_lifecycle,
            on_lost=lambda: self._lost(process, exited),
        )
        result = await self._started
        if isinstance(result, Loaded):
            spec = self._spec
            logger.info("instance %s of model '%s' is up (pid %s)", spec.instance_name, spec.model_name, process.pid)
        return result

    async def stop(self, timeout_s: float) -> None:
        self._state = InstanceState.STOPPED
        self._restarts.cancel()
        channel, process, exited = self._channel, self._process, self._exited
        if channel is not None and process is not None and is_alive(process):
            channel.shutdown()
        if process is not None and exited is not None:
            started = time.monotonic()
            if not await wait_exit(exited, timeout_s):
                logger.warning(
                    "instance %s did not stop in %.1fs; killing it",
                    self._spec.instance_name,
                    time.monotonic() - started,
                )
                process.kill()
                await wait_exit(exited, 5.0)
            close_exited(process, exited)
        if channel is not None:
            channel.close()
        self._spawner.shutdown(wait=False)

    def kill(self) -> None:
        """Forced exit: no drain, no waiting."""
        self._state = InstanceState.STOPPED
        if self._process is not None and is_alive(self._process):
            self._process.kill()

    # -- the worker's own word, and its end -------------------------------------------------------

    def _on_lifecycle(self, message: Lifecycle) -> None:
        if isinstance(message, Retiring):
            # Out of the idle pool before the scheduler can hand it another batch; restarted on exit.
            self._retiring = message.reason
            if self._state is InstanceState.READY:
                self._state = InstanceState.RESTARTING
        elif self._started is not None and not self._started.done():
            self._started.set_result(message)

    def _lost(self, process: multiprocessing.process.BaseProcess, exited: asyncio.Future[None]) -> None:
        task = asyncio.get_running_loop().create_task(self._reap(process, exited))
        self._reaping.add(task)
        task.add_done_callback(self._reaping.discard)

    async def _reap(self, process: multiprocessing.process.BaseProcess, exited: asyncio.Future[None]) -> None:
        # Let the exit code settle so the error can report it.
        await wait_exit(exited, 1.0)
        try:
            exit_code = process.exitcode
        except ValueError:
            return  # closed by stop(): this instance was stopped on purpose
        self._on_exit(process, exit_code)
        close_exited(process, exited)

    def _on_exit(self, process: multiprocessing.process.BaseProcess, exit_code: int | None) -> None:
        if process is not self._process:
            return  # an earlier process of this instance
        retiring, self._retiring = self._retiring, ""
        instance = self._instance()
        if retiring:
            reason = f"{instance} exited after a device failure ({retiring})"
        else:
            reason = f"{instance} exited unexpectedly (exit code {exit_code})"
        if self._channel is not None:
            self._channel.fail(UnavailableError(reason))
        if self._started is not None and not self._started.done():
            self._started.set_result(LoadFailed(reason))
        if self._state is not InstanceState.READY and not (retiring and self._state is InstanceState.RESTARTING):
            return  # stopping, or a start that already reports the failure
        logger.error("%s; failing its in-flight requests and restarting it", reason)
        self.reason = reason
        if self._restarts.crashed(reason):
            self._state = InstanceState.RESTARTING

    # -- restarts ---------------------------------------------------------------------------------

    async def _respawn(self) -> str | None:
        if self._state is not InstanceState.RESTARTING:
            raise asyncio.CancelledError  # stopped while waiting to restart
        try:
            if self._renew is not None:
                self._spec = self._renew(self._spec)
            result = await self._spawn()
        except OSError as error:
            return f"could not start a worker process: {error}"
        return None if isinstance(result, Loaded) else result.message

    def _back_up(self) -> None:
        self._state = InstanceState.READY
        self.reason = ""
        self._on_up()

    def _give_up(self, reason: str) -> None:
        self._state = InstanceState.FAILED
        self.reason = reason
