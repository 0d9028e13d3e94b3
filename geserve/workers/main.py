"""Worker process entry point: one model instance, batches in shared memory, control over a pipe."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import queue
import secrets
import select
import signal
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing import shared_memory
from multiprocessing.connection import Connection

import numpy as np

from geserve.backends.base import RequestResult, ResponseEmitter
from geserve.codecs import dtypes
from geserve.errors import GeserveError, ModelLoadError, UnavailableError
from geserve.workers.bls import BlsClient
from geserve.workers.messages import (
    BatchPlaced,
    BlsReply,
    Cancel,
    InstanceSpec,
    Loaded,
    LoadFailed,
    Partial,
    PlacedResult,
    ReadStatus,
    RequestInfo,
    Retiring,
    RowRange,
    RunBatch,
    Shutdown,
    StatusReport,
)
from geserve.workers.runner import Batch, InstanceRunner
from geserve.workers.runs import RunId
from geserve.workers.shm import (
    OutputPlacement,
    TensorLayout,
    TensorRef,
    attach_segment,
    buffer_of,
    create_segment,
    read_tensor,
    unlink_quietly,
    write_tensors,
)

logger = logging.getLogger(__name__)

# Outputs kept for a pipeline's next step get a segment of their own from this size: below it, creating and
# mapping a segment costs more than the copies it saves, and they go through the arena as usual.
HANDOFF_MIN_BYTES = 64 << 10
# The name suffix of pipeline handoff segments, and how many of them a worker keeps attached.
_HANDOFF_ROLE = "_handoff"
_ATTACHED_HANDOFFS = 16
# Streamed responses up to this size travel in the message itself; larger ones in a segment.
_INLINE_BYTES = 64 << 10


@dataclass(slots=True)
class _Running:
    """A batch the worker has staged or launched, and the one-off segments its inputs are read from."""

    message: RunBatch
    batch: Batch
    extra: dict[str, shared_memory.SharedMemory]


def _close(segments: dict[str, shared_memory.SharedMemory]) -> None:
    for segment in segments.values():
        with contextlib.suppress(BufferError):  # a backend may still hold a view; the OS cleans up
            segment.close()


class _Segments:
    """The worker's arenas (attached once), and the one-off segments of batches too large for them."""

    def __init__(self, spec: InstanceSpec) -> None:
        self.arenas = {name: attach_segment(name) for name in spec.arenas}
        # Pipeline handoff segments (any worker's), attached once: they are reused batch after batch.
        self._handoffs: OrderedDict[str, shared_memory.SharedMemory] = OrderedDict()

    def _handoff(self, name: str) -> shared_memory.SharedMemory:
        segment = self._handoffs.pop(name, None) or attach_segment(name)
        self._handoffs[name] = segment
        while len(self._handoffs) > _ATTACHED_HANDOFFS:
            _, oldest = self._handoffs.popitem(last=False)
            with contextlib.suppress(BufferError):
                oldest.close()
        return segment

    def _segment(self, name: str, extra: dict[str, shared_memory.SharedMemory]) -> shared_memory.SharedMemory:
        if name in self.arenas:
            return self.arenas[name]
        if name.endswith(_HANDOFF_ROLE):
            return self._handoff(name)
        if name not in extra:
            extra[name] = attach_segment(name)
        return extra[name]

    def stage(self, runner: InstanceRunner, message: RunBatch) -> _Running:
        """Read a batch's inputs from shared memory and stage it (a pipelined backend copies them to the
        device now, while the batch before it may still run)."""
        extra: dict[str, shared_memory.SharedMemory] = {}
        try:
            inputs = {
                ref.name: read_tensor(buffer_of(self._segment(ref.segment, extra)), ref) for ref in message.inputs
            }
            return _Running(message, runner.stage(inputs, message.output_names, message.requests), extra)
        except BaseException:
            _close(extra)
            raise

    def finish(self, runner: InstanceRunner, running: _Running, emit: ResponseEmitter | None = None) -> BatchPlaced:
        """Wait for (or run) a staged batch and place its outputs in shared memory."""
        message = running.message
        try:
            placement = OutputPlacement(buffer_of(self.arenas[message.output_arena]), message.output_arena)
            keep = message.keep_outputs  # the front-end keeps them: not in the arena, which the next batch reuses
            allocate = None if keep else placement.allocate
            result, whole = runner.finish(running.batch, allocate, emit, split=False)
            running.batch.inputs = {}
            blocks = _Blocks(runner.output_datatypes, placement)
            try:
                placed = blocks.place(result.results, whole, message.requests)
                overflow = message.output_overflow
                blocks.written(self._write(blocks.layout, message.output_arena, overflow, placement.end, keep))
            except (GeserveError, OSError) as error:  # the outputs do not fit in /dev/shm: every request fails
                if isinstance(error, OSError):
                    error = UnavailableError(f"the batch's outputs cannot be placed in shared memory: {error}")
                blocks, placed = _Blocks(runner.output_datatypes, placement), (error,) * len(message.requests)
            return BatchPlaced(message.batch_id, blocks.refs(), placed, result.infer_start_ns, result.infer_end_ns)
        finally:
            _close(running.extra)

    def _write(
        self, layout: TensorLayout, arena_name: str, overflow_name: str, start: int, own_segment: bool = False
    ) -> tuple[TensorRef, ...]:
        if not layout.count:
            return ()
        arena = self.arenas[arena_name]
        own_segment = own_segment and layout.size >= HANDOFF_MIN_BYTES
        if not own_segment and start + layout.size <= arena.size:
            return layout.write(buffer_of(arena), arena_name, start)
        if overflow_name.endswith(_HANDOFF_ROLE):
            target = self._handoff(overflow_name)
            if layout.size <= target.size:
                return layout.write(buffer_of(target), overflow_name)
            # Too large for it: a one-off segment (a fresh name, as the last one may still be in use).
            overflow_name = f"{overflow_name}_{secrets.token_hex(8)}"
        # Too large for the arena: a segment of its own, which the front-end unlinks after reading.
        segment = create_segment(overflow_name, layout.size)
        try:
            return layout.write(buffer_of(segment), overflow_name)
        finally:
            segment.close()


class _Outbox:
    """The pipe to the front-end. Streamed responses may come from a model's own threads while the main
    loop answers batches, so sends are serialized. Segments it creates are named for `run`, the server's."""

    def __init__(self, connection: Connection, run: RunId) -> None:
        self._connection = connection
        self.run = run
        self._lock = threading.Lock()

    def send(self, message: object) -> None:
        with self._lock:
            self._connection.send(message)

    def emitter(self, requests: tuple[RequestInfo, ...]) -> ResponseEmitter:
        def emit(index: int, outputs: Mapping[str, np.ndarray] | None, error: GeserveError | None, final: bool) -> None:
            stream_id = requests[index].stream_id
            try:
                self.send(self._partial(stream_id, outputs, error, final))
            except (OSError, ValueError):
                logger.warning("dropping a response of stream %d: the front-end is gone", stream_id)

        return emit

    def _partial(
        self, stream_id: int, outputs: Mapping[str, np.ndarray] | None, error: GeserveError | None, final: bool
    ) -> Partial:
        if not outputs:
            return Partial(stream_id, None, (), error, final)
        arrays = {name: np.asarray(array) for name, array in outputs.items()}
        if sum(array.nbytes for array in arrays.values()) <= _INLINE_BYTES:
            return Partial(stream_id, arrays, (), error, final)
        return Partial(stream_id, None, write_tensors(arrays, self.run.segment_name("stream")), error, final)


def run_worker(connection: Connection, spec: InstanceSpec) -> None:
    """Serve one instance until Shutdown or until the front-end's end of the pipe closes."""
    # Ctrl-C reaches the whole process group; the front-end decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(dict(spec.environment))  # before the backend is imported
    logging.basicConfig(
        level=spec.log_level,
        format=(
            f"%(asctime)s %(levelname)s [worker model={spec.model_name} version={spec.model_version} "
            f"instance={spec.instance_name} device={spec.device_id} pid={os.getpid()}] %(name)s: %(message)s"
        ),
    )
    runner = InstanceRunner(spec)
    # Started by hand (not by a ProcessWorker), the worker is the top of its own run.
    outbox = _Outbox(connection, spec.run or RunId.current())
    try:
        segments = _Segments(spec)
        config = runner.load()
    except ModelLoadError as error:
        connection.send(LoadFailed(error.message))
        return
    except OSError as error:
        connection.send(LoadFailed(f"instance '{spec.instance_name}' cannot map its shared memory: {error}"))
        return
    connection.send(Loaded(config.SerializeToString()))
    inbox = _Inbox(connection, runner, outbox, threaded=spec.backend == "python")
    # The batch launched on the device. While it runs, the next one (already sent when the front-end
    # pipelines) is staged, so the device starts it as soon as this one is answered.
    running: _Running | None = None
    waiter = _DeviceWaiter(runner) if runner.pipelined and not inbox.threaded else None
    try:
        while True:
            if running is not None and not inbox.ready(waiter):
                finished, running = running, None
                if not _answer(segments, runner, outbox, finished, waiter):
                    break
                continue
            try:
                message = inbox.get()
            except EOFError:
                # The front-end is gone without a Shutdown (killed): nobody else will remove the arenas.
                for name in spec.arenas:
                    unlink_quietly(name)
                break
            if isinstance(message, Shutdown):
                if running is not None:
                    _answer(segments, runner, outbox, running, waiter)
                    running = None
                break
            if isinstance(message, RunBatch):
                if running is not None and not runner.stages_ahead:
                    finished, running = running, None
                    if not _answer(segments, runner, outbox, finished, waiter):
                        break
                staged = segments.stage(runner, message)
                if running is not None:
                    finished, running = running, None
                    if not _answer(segments, runner, outbox, finished, waiter):
                        runner.discard(staged.batch)  # its requests fail with the retiring worker
                        _close(staged.extra)
                        break
                runner.launch(staged.batch)
                running = staged
                if waiter is not None:
                    waiter.watch(staged.batch)
            elif isinstance(message, ReadStatus):
                outbox.send(StatusReport(runner.status()))
            else:
                logger.error("ignoring unknown message %r", type(message).__name__)
    finally:
        if waiter is not None:
            waiter.close()
        inbox.close()
        runner.unload()
        connection.close()


class _DeviceWaiter:
    """Waits on its own thread for the launched batch to finish on the device, so that the main loop can
    take and stage the next batch meanwhile; a byte on its pipe says the batch is done."""

    def __init__(self, runner: InstanceRunner) -> None:
        self._runner = runner
        self.done, self._signal = multiprocessing.Pipe(duplex=False)
        self._batches: queue.SimpleQueue[Batch | None] = queue.SimpleQueue()
        self._pending = 0
        self._thread = threading.Thread(target=self._run, name="geserve-device-wait", daemon=True)
        self._thread.start()

    def watch(self, batch: Batch) -> None:
        self._pending += 1
        self._batches.put(batch)

    def _run(self) -> None:
        while (batch := self._batches.get()) is not None:
            self._runner.wait(batch)
            self._signal.send_bytes(b"")

    def take(self) -> None:
        """Block until the watched batch is done (so `finish` only copies its outputs out)."""
        if self._pending:
            self.done.recv_bytes()
            self._pending -= 1

    def close(self) -> None:
        self.take()  # nothing may be unloaded under the waiting thread
        self._batches.put(None)
        self._thread.join(timeout=5)
        self.done.close()
        self._signal.close()


def _answer(
    segments: _Segments, runner: InstanceRunner, outbox: _Outbox, running: _Running, waiter: _DeviceWaiter | None
) -> bool:
    """Finish a batch and send its answer; False when the device failed under it and the worker must go."""
    if waiter is not None:
        waiter.take()
    requests = running.message.requests
    outbox.send(segments.finish(runner, running, outbox.emitter(requests) if requests else None))
    if runner.fault:
        # A failed device taints everything this process holds on it: a fresh worker takes over.
        outbox.send(Retiring(runner.fault))
        return False
    return True


class _Inbox:
    """What the front-end sends. A python model may wait inside `execute` for a BLS reply, so for python
    models a reader thread takes every message: BLS replies and cancellations are handled at once, the rest
    queue for the main loop. Other backends read the pipe directly, one batch after the other."""

    _END = object()

    def __init__(self, connection: Connection, runner: InstanceRunner, outbox: _Outbox, threaded: bool) -> None:
        self._connection = connection
        self._runner = runner
        self._bls: BlsClient | None = None
        self._queue: queue.SimpleQueue[object] | None = None
        # One poll object, made once: Connection.poll builds a selector on every call.
        self._readable = select.poll()
        self._readable.register(connection.fileno(), select.POLLIN)
        self._either: select.poll | None = None  # the pipe or a device waiter's signal
        if threaded:
            from geserve.backends.python import pb_utils

            self._bls = BlsClient(outbox.send, outbox.run)
            pb_utils.set_bls_caller(self._bls.call)
            self._queue = queue.SimpleQueue()
            threading.Thread(target=self._read, name="geserve-inbox", daemon=True).start()

    @property
    def threaded(self) -> bool:
        return self._queue is not None

    def ready(self, waiter: _DeviceWaiter | None = None) -> bool:
        """Whether a message is waiting (`get` would not block). With a `waiter`, blocks until either a
        message comes or the device is done with the running batch (then False, unless both are ready)."""
        if self._queue is not None:
            return not self._queue.empty()
        try:
            if waiter is None:
                return bool(self._readable.poll(0))
            if self._either is None:
                self._either = select.poll()
                self._either.register(self._connection.fileno(), select.POLLIN)
                self._either.register(waiter.done.fileno(), select.POLLIN)
            pipe = self._connection.fileno()
            return any(fd == pipe for fd, _ in self._either.poll())
        except (OSError, ValueError):
            return True  # `get` reports the closed pipe

    def get(self) -> object:
        """The next message for the main loop; EOFError once the front-end is gone."""
        while True:
            if self._queue is None:
                message = self._connection.recv()
            else:
                message = self._queue.get()
                if message is self._END:
                    raise EOFError
            if isinstance(message, Cancel):
                self._runner.cancelled_streams.add(message.stream_id)
                continue
            return message

    def _read(self) -> None:
        assert self._queue is not None and self._bls is not None
        while True:
            try:
                message = self._connection.recv()
            except (EOFError, OSError):
                self._bls.close()
                self._queue.put(self._END)
                return
            if isinstance(message, BlsReply):
                self._bls.deliver(message)
            elif isinstance(message, Cancel):
                self._runner.cancelled_streams.add(message.stream_id)
            else:
                self._queue.put(message)
                if isinstance(message, Shutdown):
                    return

    def close(self) -> None:
        if self._bls is not None:
            self._bls.close()


class _Blocks:
    """A batch's outputs as blocks in shared memory, and each request's outputs as row ranges of them.
    One block per output holds every request's rows when the backend returned one tensor (the requests
    get consecutive views of it) or wrote it in place; per-request outputs (python models) are stacked
    into one block when their dims agree, else each is a block of its own (BYTES, ragged shapes)."""

    def __init__(self, datatypes: dict[str, str], placement: OutputPlacement) -> None:
        self._datatypes = datatypes
        self._placement = placement
        self._blocks: list[TensorRef | int] = []  # a ref in place, or the layout entry to be written
        self.layout = TensorLayout()
        self._written: tuple[TensorRef, ...] = ()

    def place(
        self, results: tuple[RequestResult, ...], whole: dict[str, np.ndarray], requests: tuple[RequestInfo, ...]
    ) -> tuple[PlacedResult, ...]:
        """Blocks for `whole` (a batch's outputs, each request's rows in turn) or else for the requests'
        own outputs, and every request's outputs as row ranges of them."""
        if whole:
            return self._place_whole(whole, requests)
        ranges: list[dict[str, RowRange]] = [{} for _ in results]
        by_name: dict[str, list[tuple[int, np.ndarray]]] = {}
        for index, result in enumerate(results):
            if not isinstance(result, GeserveError):
                for name, array in result.items():
                    by_name.setdefault(name, []).append((index, array))
        for name, entries in by_name.items():
            self._add_own(name, entries, ranges)
        return tuple(
            result if isinstance(result, GeserveError) else tuple(ranges[index][name] for name in result)
            for index, result in enumerate(results)
        )

    def _place_whole(self, whole: dict[str, np.ndarray], requests: tuple[RequestInfo, ...]) -> tuple[PlacedResult, ...]:
        """One block per output, in place where the backend wrote it there; each request has its rows of the
        outputs it asked for (a batch of one request has them whole, a model without a batch dimension too)."""
        blocks = {name: self._block(name, array) for name, array in whole.items()}
        if len(requests) == 1:
            return (tuple((blocks[name], 0, -1) for name in requests[0].output_names),)
        placed: list[PlacedResult] = []
        first = 0
        for info in requests:
            placed.append(tuple((blocks[name], first, info.rows) for name in info.output_names))
            first += info.rows
        return tuple(placed)

    def _block(self, name: str, array: np.ndarray) -> int:
        block = len(self._blocks)
        ref = self._placement.ref_of(name, array)
        if ref is not None:
            self._blocks.append(ref)
        else:
            self._blocks.append(self.layout.count)
            self.layout.add(name, self._datatype(name, array), [array])
        return block

    def _add_own(self, name: str, entries: list[tuple[int, np.ndarray]], ranges: list[dict[str, RowRange]]) -> None:
        """Per-request outputs of one name: stacked into one block when their dims agree, else one each."""
        arrays = [array for _, array in entries]
        datatype = self._datatype(name, arrays[0])
        if len(arrays) > 1 and datatype != "BYTES" and _stackable(arrays):
            block = len(self._blocks)
            self._blocks.append(self.layout.count)
            self.layout.add(name, datatype, arrays)
            first = 0
            for index, array in entries:
                ranges[index][name] = (block, first, int(array.shape[0]))
                first += int(array.shape[0])
            return
        for index, array in entries:
            ranges[index][name] = (self._block(name, array), 0, -1)

    def _datatype(self, name: str, array: np.ndarray) -> str:
        return self._datatypes.get(name) or dtypes.from_numpy(array.dtype).wire

    def written(self, refs: tuple[TensorRef, ...]) -> None:
        self._written = refs

    def refs(self) -> tuple[TensorRef, ...]:
        return tuple(block if isinstance(block, TensorRef) else self._written[block] for block in self._blocks)


def _stackable(arrays: list[np.ndarray]) -> bool:
    """Whether the arrays are row blocks of one tensor: same dtype and the same dims after the first."""
    first = arrays[0]
    return (
        first.ndim > 0
        and all(a.ndim == first.ndim and a.shape[1:] == first.shape[1:] for a in arrays)
        and all(a.dtype == first.dtype for a in arrays)
    )
