"""ProcessWorker: an instance in a spawned process, fed through shared memory, restarted when it dies."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import multiprocessing
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from multiprocessing import shared_memory
from multiprocessing.connection import Connection

import numpy as np

from geserve._generated import model_config_pb2 as mc
from geserve.codecs import dtypes
from geserve.errors import GeserveError, ModelLoadError, UnavailableError
from geserve.types import InstanceStatus
from geserve.workers import main as worker_main
from geserve.workers.client import InstanceState, ResponseSink, WorkerClient
from geserve.workers.messages import (
    BatchDone,
    Cancel,
    Executed,
    InstanceSpec,
    Loaded,
    LoadFailed,
    Partial,
    ReadStatus,
    RequestInfo,
    Retiring,
    RunBatch,
    Shutdown,
    StatusReport,
)
from geserve.workers.shm import (
    DEFAULT_ARENA_BYTES,
    TensorLayout,
    TensorRef,
    attach_segment,
    buffer_of,
    create_segment,
    read_tensor,
    segment_name,
    unlink_quietly,
)

logger = logging.getLogger(__name__)

# Above this many bytes, copies into and out of the arenas run on a thread, off the event loop.
_OFFLOAD_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """Backoff between restarts, and when a crash loop makes the instance give up."""

    first_delay_s: float = 0.5
    max_delay_s: float = 10.0
    max_crashes: int = 5
    crash_window_s: float = 60.0

    def delay(self, attempt: int) -> float:
        return float(min(self.first_delay_s * 2.0**attempt, self.max_delay_s))


@dataclass(slots=True)
class _InFlight:
    future: asyncio.Future[BatchDone]
    input_overflow: shared_memory.SharedMemory | None
    output_overflow: str


class ProcessWorker:
    """One spawned worker process. Requests are matched to answers by id; a worker that dies fails
    its in-flight batch at once with UNAVAILABLE and is restarted with backoff, unless it keeps
    crashing, which marks it FAILED with the reason."""

    def __init__(
        self,
        spec: InstanceSpec,
        arena_bytes: int = DEFAULT_ARENA_BYTES,
        restart: RestartPolicy | None = None,
        pipeline_depth: int = 1,
    ) -> None:
        self.spec = spec
        # Batches the worker may hold at once: one running, the rest waiting in its pipe, each in its
        # own pair of arenas, so the next batch is already there when the running one finishes.
        self.capacity = max(pipeline_depth, 1)
        self.on_ready: Callable[[WorkerClient], None] | None = None
        self.reason = ""
        self._arena_bytes = arena_bytes
        self._restart_policy = restart or RestartPolicy()
        self._context = multiprocessing.get_context("spawn")
        self._state = InstanceState.STARTING
        self._arenas: dict[str, shared_memory.SharedMemory] = {}
        self._slots: list[tuple[str, str]] = []  # (input arena, output arena) per slot
        self._free_slots: asyncio.Queue[int] = asyncio.Queue()
        self._process: multiprocessing.process.BaseProcess | None = None
        self._exited: asyncio.Future[None] | None = None  # the current process's exit, reaped once
        self._connection: Connection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Starting a spawned interpreter blocks; it happens on this thread, off the event loop.
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix=f"geserve-spawn-{spec.instance_name}")
        self._ids = itertools.count()
        self._in_flight: dict[int, _InFlight] = {}
        self._started: asyncio.Future[Loaded | LoadFailed] | None = None
        self._crashes: collections.deque[float] = collections.deque()
        self._restarter: asyncio.Task[None] | None = None
        self._retiring = ""  # why the worker said it is exiting on purpose
        self._pipe_lost = False  # the current worker's pipe ended: it is gone, even before its exit is reaped
        self._streams: dict[int, ResponseSink] = {}  # open streamed requests, by stream id
        self._status: asyncio.Future[InstanceStatus | None] | None = None
        self.model_ready = True

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
        return _pid(self._process)

    @property
    def segments(self) -> list[str]:
        return list(self._arenas)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> mc.ModelConfig:
        self._loop = asyncio.get_running_loop()
        try:
            for slot in range(self.capacity):
                pair = (segment_name("in"), segment_name("out"))
                for name in pair:
                    self._arenas[name] = create_segment(name, self._arena_bytes)
                self._slots.append(pair)
                self._free_slots.put_nowait(slot)
            self.spec = replace(self.spec, arenas=tuple(self._arenas))
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
        self._exited = exited = _watch_exit(process)
        # Answers are small control messages: read them on the loop when the pipe is readable.
        loop.add_reader(parent.fileno(), self._on_readable, parent, process, exited)
        result = await self._started
        if isinstance(result, Loaded):
            logger.info(
                "instance %s of model '%s' is up (pid %s)", self.spec.instance_name, self.spec.model_name, process.pid
            )
        return result

    async def stop(self, timeout_s: float) -> None:
        self._state = InstanceState.STOPPED
        if self._restarter is not None:
            self._restarter.cancel()
        connection, process, exited = self._connection, self._process, self._exited
        if connection is not None and process is not None and _alive(process):
            with contextlib.suppress(OSError, ValueError):  # the worker may be gone already
                connection.send(Shutdown())
        if process is not None and exited is not None:
            started = time.monotonic()
            if not await _wait(exited, timeout_s):
                logger.warning(
                    "instance %s did not stop in %.1fs; killing it", self.spec.instance_name, time.monotonic() - started
                )
                process.kill()
                await _wait(exited, 5.0)
            _close(process, exited)
        if connection is not None:
            self._forget(connection)
        self._spawner.shutdown(wait=False)
        self.release_segments()

    def release_segments(self) -> None:
        """Unlink every segment this instance owns (also usable from a signal handler's fast path)."""
        for arena in self._arenas.values():
            with contextlib.suppress(BufferError):
                arena.close()
            with contextlib.suppress(FileNotFoundError):
                arena.unlink()
        self._arenas.clear()

    def kill(self) -> None:
        """Forced exit: no drain, no waiting."""
        self._state = InstanceState.STOPPED
        if self._process is not None and _alive(self._process):
            self._process.kill()
        self.release_segments()

    # -- batches -----------------------------------------------------------------------------

    async def execute(
        self,
        inputs: Mapping[str, Sequence[np.ndarray]],
        output_names: tuple[str, ...],
        requests: Sequence[RequestInfo] = (),
        sinks: Sequence[ResponseSink | None] = (),
    ) -> Executed:
        slot = await self._free_slots.get()
        streams: list[int] = []
        try:
            infos = list(requests)
            for index, sink in enumerate(sinks):
                if sink is not None:
                    stream_id = next(self._ids)
                    self._streams[stream_id] = sink
                    streams.append(stream_id)
                    infos[index] = replace(infos[index], stream_id=stream_id)
            executed = await self._execute(slot, inputs, output_names, tuple(infos))
            if executed.error is not None:
                for stream_id in streams:  # the scheduler answers them with the batch's error
                    self._streams.pop(stream_id, None)
            return executed
        except BaseException:
            for stream_id in streams:
                self._streams.pop(stream_id, None)
            raise
        finally:
            self._free_slots.put_nowait(slot)

    def cancel_stream(self, sink: ResponseSink) -> None:
        for stream_id, registered in list(self._streams.items()):
            if registered is sink:
                del self._streams[stream_id]
                if self._connection is not None and self.alive:
                    with contextlib.suppress(OSError, ValueError):
                        self._connection.send(Cancel(stream_id))

    async def _execute(
        self,
        slot: int,
        inputs: Mapping[str, Sequence[np.ndarray]],
        output_names: tuple[str, ...],
        requests: tuple[RequestInfo, ...],
    ) -> Executed:
        connection, loop = self._connection, self._loop
        if not self.alive or connection is None or loop is None or not self._arenas:
            raise UnavailableError(self._exited_message())
        input_name, output_name = self._slots[slot]
        arena = self._arenas[input_name]
        layout = TensorLayout()
        for name, parts in inputs.items():
            layout.add(name, dtypes.from_numpy(parts[0].dtype).wire, parts)
        overflow = None
        if layout.size > arena.size:
            # A batch too large for the arena; reserving its pages takes a while, so off the loop.
            overflow = await asyncio.to_thread(create_segment, segment_name("in"), layout.size)
        target = overflow if overflow is not None else arena
        segment = overflow.name if overflow is not None else input_name
        if layout.size > _OFFLOAD_BYTES:
            refs = await asyncio.to_thread(layout.write, buffer_of(target), segment)
        else:
            refs = layout.write(buffer_of(target), segment)
        request_id = next(self._ids)
        flight = _InFlight(loop.create_future(), overflow, segment_name("out"))
        self._in_flight[request_id] = flight
        try:
            # A few hundred bytes: the pipe takes them at once, so no thread hop is needed.
            connection.send(RunBatch(request_id, refs, output_names, output_name, flight.output_overflow, requests))
            done = await flight.future
            return await self._collect(done)
        except (OSError, ValueError):
            # The pipe broke (or was closed on EOF) before the exit was reaped: the worker is gone.
            raise UnavailableError(self._exited_message()) from None
        finally:
            self._in_flight.pop(request_id, None)
            self._release_flight(flight)

    async def read_status(self) -> InstanceStatus | None:
        """Device usage, the model's readiness and metrics, read by the worker between batches."""
        connection = self._connection
        if not self.alive or connection is None or self._loop is None:
            return None
        if self._status is None or self._status.done():
            self._status = self._loop.create_future()
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

    async def _collect(self, done: BatchDone) -> Executed:
        if done.error is not None:
            return Executed(None, done.error, done.infer_start_ns, done.infer_end_ns)
        if done.responses is not None:
            refs = tuple(ref for item in done.responses if not isinstance(item, GeserveError) for ref in item)
            if sum(ref.nbytes for ref in refs) > _OFFLOAD_BYTES:
                read = await asyncio.to_thread(self._read_outputs_list, refs)
            else:
                read = self._read_outputs_list(refs)
            responses: list[dict[str, np.ndarray] | GeserveError] = []
            start = 0
            for item in done.responses:
                if isinstance(item, GeserveError):
                    responses.append(item)
                else:
                    responses.append(dict(read[start : start + len(item)]))
                    start += len(item)
            return Executed(None, None, done.infer_start_ns, done.infer_end_ns, tuple(responses))
        total = sum(ref.nbytes for ref in done.outputs)
        if total > _OFFLOAD_BYTES:
            outputs = await asyncio.to_thread(self._read_outputs, done.outputs)
        else:
            outputs = self._read_outputs(done.outputs)
        return Executed(outputs, None, done.infer_start_ns, done.infer_end_ns)

    def _read_outputs(self, refs: tuple[TensorRef, ...]) -> dict[str, np.ndarray]:
        return dict(self._read_outputs_list(refs))

    def _read_outputs_list(self, refs: tuple[TensorRef, ...]) -> list[tuple[str, np.ndarray]]:
        """Copy the outputs out of shared memory once; the arena is reused by the next batch."""
        outputs: list[tuple[str, np.ndarray]] = []
        overflow: shared_memory.SharedMemory | None = None
        try:
            for ref in refs:
                segment = self._arenas.get(ref.segment)
                if segment is None:
                    overflow = overflow or attach_segment(ref.segment)
                    segment = overflow
                buffer = buffer_of(segment)
                view = read_tensor(buffer, ref)
                outputs.append((ref.name, view if ref.datatype == "BYTES" else view.copy()))
                del view
            return outputs
        finally:
            if overflow is not None:
                overflow.close()
                overflow.unlink()

    def _release_flight(self, flight: _InFlight) -> None:
        if flight.input_overflow is not None:
            with contextlib.suppress(BufferError):
                flight.input_overflow.close()
            with contextlib.suppress(FileNotFoundError):
                flight.input_overflow.unlink()
        unlink_quietly(flight.output_overflow)  # left behind when the worker died mid-write

    def _exited_message(self) -> str:
        if self._state is InstanceState.READY and self._pipe_lost:
            return f"{self._instance()} exited unexpectedly"
        return self._unavailable()

    def _instance(self) -> str:
        return (
            f"instance '{self.spec.instance_name}' of model '{self.spec.model_name}' version {self.spec.model_version}"
        )

    def _unavailable(self) -> str:
        reason = f" ({self.reason})" if self.reason else ""
        return f"{self._instance()} is {self._state.value}{reason}"

    # -- the pipe ----------------------------------------------------------------------------

    def _on_readable(
        self, connection: Connection, process: multiprocessing.process.BaseProcess, exited: asyncio.Future[None]
    ) -> None:
        try:
            while connection.poll():
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

    async def _reap(self, process: multiprocessing.process.BaseProcess, exited: asyncio.Future[None]) -> None:
        # Let the exit code settle so the error can report it.
        await _wait(exited, 1.0)
        try:
            exit_code = process.exitcode
        except ValueError:
            return  # closed by stop(): this instance was stopped on purpose
        self._on_exit(process, exit_code)
        _close(process, exited)

    def _on_message(self, message: object) -> None:
        if isinstance(message, BatchDone):
            flight = self._in_flight.get(message.request_id)
            if flight is not None and not flight.future.done():
                flight.future.set_result(message)
        elif isinstance(message, Loaded | LoadFailed):
            if self._started is not None and not self._started.done():
                self._started.set_result(message)
        elif isinstance(message, Partial):
            self._on_partial(message)
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
            outputs = self._read_outputs(message.refs)  # also unlinks the response's own segment
        sink = self._streams.pop(message.stream_id, None) if message.final else self._streams.get(message.stream_id)
        if sink is not None:
            sink(outputs, message.error, message.final)

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
        for flight in self._in_flight.values():
            if not flight.future.done():
                flight.future.set_exception(error)
        streams, self._streams = self._streams, {}
        for sink in streams.values():
            sink(None, error, True)
        if self._state is not InstanceState.READY and not (retiring and self._state is InstanceState.RESTARTING):
            return  # stopping, or a start that already reports the failure
        logger.error("%s; failing its in-flight requests and restarting it", reason)
        self.reason = reason
        now = time.monotonic()
        self._crashes.append(now)
        while self._crashes and now - self._crashes[0] > self._restart_policy.crash_window_s:
            self._crashes.popleft()
        if len(self._crashes) >= self._restart_policy.max_crashes:
            self._give_up(
                f"{reason}; it crashed {len(self._crashes)} times within {self._restart_policy.crash_window_s:.0f}s"
            )
            return
        self._state = InstanceState.RESTARTING
        self._restarter = asyncio.get_running_loop().create_task(self._restart())

    def _give_up(self, reason: str) -> None:
        self._state = InstanceState.FAILED
        self.reason = reason
        logger.error("giving up on instance %s: %s", self.spec.instance_name, reason)

    async def _restart(self) -> None:
        attempt = len(self._crashes) - 1
        while self._state is InstanceState.RESTARTING:
            await asyncio.sleep(self._restart_policy.delay(attempt))
            if self._state is not InstanceState.RESTARTING:
                return
            try:
                result: Loaded | LoadFailed = await self._spawn()
            except OSError as error:
                result = LoadFailed(f"could not start a worker process: {error}")
            if isinstance(result, Loaded):
                self._state = InstanceState.READY
                self.reason = ""
                if self.on_ready is not None:
                    self.on_ready(self)
                return
            attempt += 1
            if attempt >= self._restart_policy.max_crashes:
                self._give_up(f"restart failed: {result.message}")
                return


def _watch_exit(process: multiprocessing.process.BaseProcess) -> asyncio.Future[None]:
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


async def _wait(exited: asyncio.Future[None], timeout_s: float) -> bool:
    """Whether the process exited within the timeout; the watch itself goes on either way."""
    try:
        await asyncio.wait_for(asyncio.shield(exited), timeout_s)
    except TimeoutError:
        return False
    return True


def _join(process: multiprocessing.process.BaseProcess) -> None:
    with contextlib.suppress(ValueError):  # closed: already reaped
        process.join()


def _alive(process: multiprocessing.process.BaseProcess) -> bool:
    try:
        return process.is_alive()
    except ValueError:  # closed: it exited and was reaped
        return False


def _pid(process: multiprocessing.process.BaseProcess | None) -> int | None:
    try:
        return process.pid if process is not None else None
    except ValueError:
        return None


def _close(process: multiprocessing.process.BaseProcess, exited: asyncio.Future[None]) -> None:
    """Release the process object's pipe (its sentinel) once it has exited; the garbage collector
    would, but only now and then, so a model reloaded in a loop held ever more of them."""
    if not exited.done():
        return  # the exit watch still has the sentinel registered on the loop
    with contextlib.suppress(ValueError):  # still running: the object keeps its pipe until reaped
        process.close()
