"""ProcessWorker: an instance in a spawned process, fed through its arenas, supervised when it dies."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import multiprocessing
import select
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from multiprocessing.connection import Connection

from geserve._generated import model_config_pb2 as mc
from geserve.errors import GeserveError, ModelLoadError, UnavailableError
from geserve.settings import DEFAULT_ARENA_BYTES
from geserve.types import InstanceStatus
from geserve.workers import main as worker_main
from geserve.workers.arenas import Arenas
from geserve.workers.batch import Batch
from geserve.workers.bls_serving import ModelCaller, serve_call
from geserve.workers.client import InstanceState, WorkerClient
from geserve.workers.exits import close_exited, is_alive, pid_of, wait_exit, watch_exit
from geserve.workers.handoff import HandoffSegments, MappedOutputs
from geserve.workers.messages import (
    BatchPlaced,
    BatchResult,
    BlsCall,
    BlsReply,
    Cancel,
    InstanceSpec,
    Loaded,
    LoadFailed,
    Partial,
    ReadStatus,
    Retiring,
    RunBatch,
    Shutdown,
    StatusReport,
)
from geserve.workers.runs import RunId
from geserve.workers.shm import unlink_quietly
from geserve.workers.streams import ResponseStream
from geserve.workers.supervisor import RestartPolicy, Supervisor

logger = logging.getLogger(__name__)

__all__ = ["ProcessWorker", "RestartPolicy"]


class ProcessWorker:
    """One spawned worker process. Batches are matched to answers by id; a worker that dies fails its
    in-flight batches and open streams at once with UNAVAILABLE, and its Supervisor restarts it."""

    def __init__(
        self,
        spec: InstanceSpec,
        arena_bytes: int = DEFAULT_ARENA_BYTES,
        restart: RestartPolicy | None = None,
        pipeline_depth: int = 1,
        caller: Callable[[], ModelCaller | None] | None = None,
        *,
        run: RunId | None = None,
        mapped: MappedOutputs | None = None,
    ) -> None:
        # The run whose segments these are (by default this process's), and the pipeline outputs mapped
        # here (shared by the pool factory's workers, so one's outputs pass on to another in place).
        self._run = run or RunId.current()
        mapped = mapped or MappedOutputs()
        self.spec = replace(spec, run=self._run)
        # Where the model's BLS requests go (the server, once it is up).
        self._caller = caller or (lambda: None)
        self._bls_tasks: set[asyncio.Task[None]] = set()
        # Recent BLS reply segments: a worker that dies before reading one cannot unlink it, so we do.
        self._bls_segments: deque[str] = deque(maxlen=256)
        # Batches the worker may hold at once: one running, the rest waiting in its pipe, each in its
        # own pair of arenas, so the next batch is already there when the running one finishes.
        self.capacity = max(pipeline_depth, 1)
        self.on_ready: Callable[[WorkerClient], None] | None = None
        self.reason = ""
        self.model_ready = True
        self.incarnation = 0
        self._arenas = Arenas(self.capacity, arena_bytes, self._run, mapped)
        self._handoff = HandoffSegments(arena_bytes, self._run, mapped)
        self._supervisor = Supervisor(
            spec.instance_name, restart or RestartPolicy(), self._respawn, self._back_up, self._give_up
        )
        self._context = multiprocessing.get_context("spawn")
        self._state = InstanceState.STARTING
        self._process: multiprocessing.process.BaseProcess | None = None
        self._exited: asyncio.Future[None] | None = None  # the current process's exit, reaped once
        self._connection: Connection | None = None
        # Starting a spawned interpreter blocks; it happens on this thread, off the event loop.
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix=f"geserve-spawn-{spec.instance_name}")
        self._ids = itertools.count()
        self._in_flight: dict[int, asyncio.Future[BatchPlaced]] = {}
        self._streams: dict[int, ResponseStream] = {}  # open streamed requests, by stream id
        self._started: asyncio.Future[Loaded | LoadFailed] | None = None
        self._status: asyncio.Future[InstanceStatus | None] | None = None
        self._retiring = ""  # why the worker said it is exiting on purpose
        self._pipe_lost = False  # the current worker's pipe ended: it is gone, even before its exit is reaped

    @property
    def alive(self) -> bool:
        return self._state is InstanceState.READY and not self._pipe_lost

    @property
    def recoverable(self) -> bool:
        return self._state in (InstanceState.READY, InstanceState.RESTARTING)

    @property
    def state(self) -> InstanceState:
        return self._state

    @property
    def pid(self) -> int | None:
        return pid_of(self._process)

    @property
    def segments(self) -> list[str]:
        return list(self._arenas.names)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> mc.ModelConfig:
        try:
            self._arenas.create()
            self.spec = replace(self.spec, arenas=self._arenas.names)
            result = await self._spawn()
        except (GeserveError, OSError) as error:
            await self.stop(timeout_s=5.0)
            message = error.message if isinstance(error, GeserveError) else str(error)
            raise ModelLoadError(f"instance '{self.spec.instance_name}' could not start: {message}") from None
        if isinstance(result, LoadFailed):
            await self.stop(timeout_s=5.0)
            raise ModelLoadError(result.message)
        self._state = InstanceState.READY
        return mc.ModelConfig.FromString(result.config)

    async def _spawn(self) -> Loaded | LoadFailed:
        loop = asyncio.get_running_loop()
        self._pipe_lost = False
        self.incarnation += 1
        parent, child = self._context.Pipe(duplex=True)
        process = self._context.Process(
            target=worker_main.run_worker,
            args=(child, self.spec),
            name=f"geserve-worker-{self.spec.instance_name}",
            daemon=True,
        )
        self._started = loop.create_future()
        await loop.run_in_executor(self._spawner, process.start)
        child.close()
        self._process, self._connection = process, parent
        self._exited = exited = watch_exit(process)
        # Answers are small control messages: read them on the loop when the pipe is readable.
        # Whether more answers are waiting: one poll object per pipe, as Connection.poll builds a selector per call.
        waiting = select.poll()
        waiting.register(parent.fileno(), select.POLLIN)
        loop.add_reader(parent.fileno(), self._on_readable, parent, process, exited, waiting)
        result = await self._started
        if isinstance(result, Loaded):
            logger.info(
                "instance %s of model '%s' is up (pid %s)", self.spec.instance_name, self.spec.model_name, process.pid
            )
        return result

    async def stop(self, timeout_s: float) -> None:
        self._state = InstanceState.STOPPED
        self._supervisor.cancel()
        connection, process, exited = self._connection, self._process, self._exited
        if connection is not None and process is not None and is_alive(process):
            with contextlib.suppress(OSError, ValueError):  # the worker may be gone already
                connection.send(Shutdown())
        if process is not None and exited is not None:
            started = time.monotonic()
            if not await wait_exit(exited, timeout_s):
                logger.warning(
                    "instance %s did not stop in %.1fs; killing it", self.spec.instance_name, time.monotonic() - started
                )
                process.kill()
                await wait_exit(exited, 5.0)
            close_exited(process, exited)
        if connection is not None:
            self._forget(connection)
        self._spawner.shutdown(wait=False)
        self._arenas.unlink()
        self._handoff.close()

    def kill(self) -> None:
        """Forced exit: no drain, no waiting."""
        self._state = InstanceState.STOPPED
        if self._process is not None and is_alive(self._process):
            self._process.kill()
        self._arenas.unlink()
        self._handoff.close()

    # -- batches -----------------------------------------------------------------------------

    async def execute(self, batch: Batch) -> BatchResult:
        if not self.alive or not self._arenas.available:
            raise UnavailableError(self._exited_message())
        placement = await self._arenas.place(batch.inputs)
        infos = list(batch.requests)
        stream_ids: dict[int, int] = {}  # request index -> stream id
        for index, stream in batch.streams.items():
            stream_id = next(self._ids)
            self._streams[stream_id] = stream
            stream.on_cancel(functools.partial(self._cancel, stream_id))
            stream_ids[index] = stream_id
            infos[index] = infos[index]._replace(stream_id=stream_id)
        batch_id = next(self._ids)
        failed = set(stream_ids)  # streams the scheduler ends with an error: forgotten here
        collected = False
        # A pipeline's step: its outputs go to a segment of their own, which the next step reads in place.
        handoff_segment = self._handoff.acquire() if batch.keep_outputs else ""
        try:
            connection, loop = self._connection, asyncio.get_running_loop()
            if not self.alive or connection is None:
                raise UnavailableError(self._exited_message())
            self._in_flight[batch_id] = answer = loop.create_future()
            arena, overflow = placement.output_arena, handoff_segment or placement.output_overflow
            message = RunBatch(
                batch_id, placement.inputs, batch.output_names, arena, overflow, tuple(infos), batch.keep_outputs
            )
            # A few hundred bytes: the pipe takes them at once, so no thread hop is needed.
            connection.send(message)
            placed = await answer
            if handoff_segment and placed.blocks and placed.blocks[0].segment not in self._arenas.names:
                results = self._handoff.map_results(handoff_segment, placed.blocks, placed.results)
                handoff_segment = ""  # its views own it now
            else:  # small outputs come through the arena, as any batch's
                results = await self._arenas.collect(placed.blocks, placed.results)
            collected = True
            failed = {index for index in stream_ids if isinstance(results[index], GeserveError)}
            return BatchResult(results, placed.infer_start_ns, placed.infer_end_ns)
        except (OSError, ValueError):
            # The pipe broke (or was closed on EOF) before the exit was reaped: the worker is gone.
            raise UnavailableError(self._exited_message()) from None
        finally:
            self._in_flight.pop(batch_id, None)
            self._arenas.release(placement, collected)
            if handoff_segment:
                self._handoff.release(handoff_segment)
            for index in failed:
                self._streams.pop(stream_ids[index], None)

    def _cancel(self, stream_id: int) -> None:
        """The client of a streamed request went away: tell the model, drop what it still sends."""
        self._streams.pop(stream_id, None)
        if self._connection is not None and self.alive:
            with contextlib.suppress(OSError, ValueError):
                self._connection.send(Cancel(stream_id))

    async def read_status(self) -> InstanceStatus | None:
        """Device usage, the model's readiness and metrics, read by the worker between batches."""
        connection = self._connection
        if not self.alive or connection is None:
            return None
        if self._status is None or self._status.done():
            self._status = asyncio.get_running_loop().create_future()
            try:
                connection.send(ReadStatus())
            except (OSError, ValueError):
                return None
        try:
            status = await asyncio.wait_for(asyncio.shield(self._status), timeout=10.0)
        except TimeoutError:
            return None
        if status is not None:
            self.model_ready = status.ready
        return status

    def _exited_message(self) -> str:
        if self._state is InstanceState.READY and self._pipe_lost:
            return f"{self._instance()} exited unexpectedly"
        reason = f" ({self.reason})" if self.reason else ""
        return f"{self._instance()} is {self._state.value}{reason}"

    def _instance(self) -> str:
        return (
            f"instance '{self.spec.instance_name}' of model '{self.spec.model_name}' version {self.spec.model_version}"
        )

    # -- the pipe ----------------------------------------------------------------------------

    def _on_readable(
        self,
        connection: Connection,
        process: multiprocessing.process.BaseProcess,
        exited: asyncio.Future[None],
        waiting: select.poll,
    ) -> None:
        try:
            while waiting.poll(0):
                self._on_message(connection.recv())
        except (EOFError, OSError):
            if process is self._process:
                self._pipe_lost = True
            self._forget(connection)
            asyncio.get_running_loop().create_task(self._reap(process, exited))

    def _forget(self, connection: Connection) -> None:
        with contextlib.suppress(ValueError, OSError):  # already closed
            asyncio.get_running_loop().remove_reader(connection.fileno())
        connection.close()
        while self._bls_segments:
            unlink_quietly(self._bls_segments.popleft())

    def _serve_bls(self, call: BlsCall) -> None:
        """A BLS request of the model: run on the server, answered on the pipe it came from."""
        connection = self._connection

        def reply(answer: BlsReply) -> None:
            names = {ref.segment for ref in answer.outputs}
            if connection is self._connection and connection is not None and not connection.closed:
                try:
                    connection.send(answer)
                    self._bls_segments.extend(names)
                    return
                except (OSError, ValueError):
                    pass
            for name in names:  # nobody will read it
                unlink_quietly(name)

        task = asyncio.get_running_loop().create_task(serve_call(self._caller(), call, reply, self._run))
        self._bls_tasks.add(task)
        task.add_done_callback(self._bls_tasks.discard)

    async def _reap(self, process: multiprocessing.process.BaseProcess, exited: asyncio.Future[None]) -> None:
        # Let the exit code settle so the error can report it.
        await wait_exit(exited, 1.0)
        try:
            exit_code = process.exitcode
        except ValueError:
            return  # closed by stop(): this instance was stopped on purpose
        self._on_exit(process, exit_code)
        close_exited(process, exited)

    def _on_message(self, message: object) -> None:
        if isinstance(message, BatchPlaced):
            answer = self._in_flight.get(message.batch_id)
            if answer is not None and not answer.done():
                answer.set_result(message)
        elif isinstance(message, Partial):
            self._on_partial(message)
        elif isinstance(message, BlsCall):
            self._serve_bls(message)
        elif isinstance(message, Loaded | LoadFailed):
            if self._started is not None and not self._started.done():
                self._started.set_result(message)
        elif isinstance(message, StatusReport):
            if self._status is not None and not self._status.done():
                self._status.set_result(message.status)
        elif isinstance(message, Retiring):
            # Out of the idle pool before the scheduler can hand it another batch; restarted on exit.
            self._retiring = message.reason
            if self._state is InstanceState.READY:
                self._state = InstanceState.RESTARTING
        else:
            logger.error("instance %s sent an unknown message %r", self.spec.instance_name, type(message).__name__)

    def _on_partial(self, message: Partial) -> None:
        outputs = message.outputs
        if message.refs:
            arrays = self._arenas.read(message.refs)  # also unlinks the response's own segment
            outputs = {ref.name: array for ref, array in zip(message.refs, arrays, strict=True)}
        stream = self._streams.pop(message.stream_id, None) if message.final else self._streams.get(message.stream_id)
        if stream is not None:
            stream.put(outputs, message.error, message.final)

    def _on_exit(self, process: multiprocessing.process.BaseProcess, exit_code: int | None) -> None:
        if process is not self._process:
            return  # an earlier process of this instance
        retiring, self._retiring = self._retiring, ""
        instance = self._instance()
        if retiring:
            reason = f"{instance} exited after a device failure ({retiring})"
        else:
            reason = f"{instance} exited unexpectedly (exit code {exit_code})"
        if self._status is not None and not self._status.done():
            self._status.set_result(None)
        if self._started is not None and not self._started.done():
            self._started.set_result(LoadFailed(reason))
        error = UnavailableError(reason)
        for answer in self._in_flight.values():
            if not answer.done():
                answer.set_exception(error)
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.fail(error)
        if self._state is not InstanceState.READY and not (retiring and self._state is InstanceState.RESTARTING):
            return  # stopping, or a start that already reports the failure
        logger.error("%s; failing its in-flight requests and restarting it", reason)
        self.reason = reason
        if self._supervisor.crashed(reason):
            self._state = InstanceState.RESTARTING

    # -- supervision -------------------------------------------------------------------------

    async def _respawn(self) -> str | None:
        if self._state is not InstanceState.RESTARTING:
            raise asyncio.CancelledError  # stopped while waiting to restart
        try:
            result = await self._spawn()
        except OSError as error:
            return f"could not start a worker process: {error}"
        return None if isinstance(result, Loaded) else result.message

    def _back_up(self) -> None:
        self._state = InstanceState.READY
        self.reason = ""
        if self.on_ready is not None:
            self.on_ready(self)

    def _give_up(self, reason: str) -> None:
        self._state = InstanceState.FAILED
        self.reason = reason
