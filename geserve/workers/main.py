"""Worker process entry point: one model instance, batches in shared memory, control over a pipe."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import queue
import secrets
import signal
import threading
from collections import OrderedDict
from dataclasses import dataclass
from multiprocessing import shared_memory
from multiprocessing.connection import Connection

from geserve.backends.base import ResponseEmitter
from geserve.errors import GeserveError, ModelLoadError, UnavailableError
from geserve.types import response_parameters
from geserve.workers.lineage import GROUP_SIGNALS, watch_parent
from geserve.workers.mailbox import Inbox, Outbox
from geserve.workers.messages import (
    BatchPlaced,
    InstanceSpec,
    Loaded,
    LoadFailed,
    ReadStatus,
    Retiring,
    RunBatch,
    Shutdown,
    StatusReport,
)
from geserve.workers.output_blocks import OutputBlocks
from geserve.workers.runner import InstanceRunner, StagedBatch
from geserve.workers.runs import RunId
from geserve.workers.shm import (
    REQUEST_ARENA_ROLE,
    InPlaceOutputs,
    TensorLayout,
    TensorRef,
    attach_foreign_segment,
    attach_segment,
    buffer_of,
    create_segment,
    read_tensor,
    unlink_quietly,
)

logger = logging.getLogger(__name__)

# Outputs kept for a pipeline's next step get a segment of their own from this size: below it, creating and
# mapping a segment costs more than the copies it saves, and they go through the arena as usual.
HANDOFF_MIN_BYTES = 64 << 10
# The name suffix of pipeline handoff segments, and how many of them a worker keeps attached.
_HANDOFF_ROLE = "_handoff"
_ATTACHED_HANDOFFS = 16


@dataclass(slots=True)
class _Running:
    """A batch the worker has staged or launched, and the one-off segments its inputs are read from."""

    message: RunBatch
    batch: StagedBatch
    extra: dict[str, shared_memory.SharedMemory]


def _close(segments: dict[str, shared_memory.SharedMemory]) -> None:
    for segment in segments.values():
        with contextlib.suppress(BufferError):  # a backend may still hold a view; the OS cleans up
            segment.close()


class _ShmBatchRunner:
    """Runs the batches RunBatch messages describe through shared memory: reads their inputs from the worker's
    arenas (attached once), the segments reused batch after batch (pipeline handoffs, protocol processes' request
    arenas) and the one-off segments of batches too large for an arena, stages them on the instance runner, and
    writes their outputs back to shared memory."""

    def __init__(self, spec: InstanceSpec) -> None:
        self.arenas = {name: attach_segment(name) for name in spec.arenas}
        # Pipeline handoff segments (any worker's) and the protocol processes' request arenas, attached once:
        # they are reused batch after batch.
        self._handoffs: OrderedDict[str, shared_memory.SharedMemory] = OrderedDict()

    def _handoff(self, name: str, foreign: bool = False) -> shared_memory.SharedMemory:
        segment = self._handoffs.pop(name, None) or (attach_foreign_segment(name) if foreign else attach_segment(name))
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
        if name.rsplit("_", 1)[-1].startswith(REQUEST_ARENA_ROLE):
            return self._handoff(name, foreign=True)  # a protocol process's arena: reused, like a handoff
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
            in_place = InPlaceOutputs(buffer_of(self.arenas[message.output_arena]), message.output_arena)
            keep = message.keep_outputs  # the front-end keeps them: not in the arena, which the next batch reuses
            allocate = None if keep else in_place.allocate
            result, whole = runner.finish(running.batch, allocate, emit, split=False)
            running.batch.inputs = {}
            blocks = OutputBlocks(runner.output_datatypes, in_place)
            try:
                placed = blocks.place(result.results, whole, message.requests)
                overflow = message.output_overflow
                blocks.written(self._write(blocks.layout, message.output_arena, overflow, in_place.end, keep))
            except (GeserveError, OSError) as error:  # the outputs do not fit in /dev/shm: every request fails
                if isinstance(error, OSError):
                    error = UnavailableError(f"the batch's outputs cannot be placed in shared memory: {error}")
                blocks, placed = OutputBlocks(runner.output_datatypes, in_place), (error,) * len(message.requests)
            parameters = tuple(response_parameters(outcome) for outcome in result.results)
            kept = parameters if any(parameters) else ()
            return BatchPlaced(
                message.batch_id, blocks.refs(), placed, result.infer_start_ns, result.infer_end_ns, kept
            )
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


def run_worker(connection: Connection, spec: InstanceSpec) -> None:
    """Serve one instance until Shutdown or until the front-end's end of the pipe closes."""
    # Ctrl-C and a service manager's SIGTERM reach the whole process group; the server decides when workers stop
    # (a Shutdown message, or its end of the pipe closing).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Blocked while the process started (lineage.start_shielded): ignored now, pending ones are discarded.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, GROUP_SIGNALS)
    os.environ.update(dict(spec.environment))  # before the backend is imported
    logging.basicConfig(
        level=spec.log_level,
        format=(
            f"%(asctime)s %(levelname)s [worker model={spec.model_name} version={spec.model_version} "
            f"instance={spec.instance_name} device={spec.device_id} pid={os.getpid()}] %(name)s: %(message)s"
        ),
    )
    # A front-end killed outright while this worker's model is stuck: nobody else removes the arenas.
    watch_parent(lambda: _unlink_all(spec.arenas))
    runner = InstanceRunner(spec)
    # Started by hand (not by a ProcessWorker), the worker is the top of its own run.
    outbox = Outbox(connection, spec.run or RunId.current())
    inboxes: list[Inbox] = []

    def open_inbox(threaded: bool) -> None:
        # Before the model's initialize runs: it may wait for the server's answers (BLS, load_model).
        inboxes.append(Inbox(connection, runner.cancelled, outbox, threaded, loading=spec.model_name))

    try:
        batches = _ShmBatchRunner(spec)
        config = runner.load(open_inbox)
    except ModelLoadError as error:
        outbox.send(LoadFailed(error.message))
        return
    except OSError as error:
        outbox.send(LoadFailed(f"instance '{spec.instance_name}' cannot map its shared memory: {error}"))
        return
    inbox = inboxes[0] if inboxes else Inbox(connection, runner.cancelled, outbox, threaded=False)
    inbox.loaded()
    outbox.send(Loaded(config.SerializeToString()))
    # The batch launched on the device. While it runs, the next one (already sent when the front-end
    # pipelines) is staged, so the device starts it as soon as this one is answered.
    running: _Running | None = None
    waiter = _DeviceWaiter(runner) if runner.pipelined and not inbox.threaded else None
    try:
        while True:
            if running is not None and not inbox.ready(waiter.done if waiter is not None else None):
                finished, running = running, None
                if not _answer(batches, runner, outbox, finished, waiter):
                    break
                continue
            try:
                message = inbox.get()
            except EOFError:
                # The front-end is gone without a Shutdown (killed): nobody else will remove the arenas.
                _unlink_all(spec.arenas)
                break
            if isinstance(message, Shutdown):
                if running is not None:
                    _answer(batches, runner, outbox, running, waiter)
                    running = None
                break
            if isinstance(message, RunBatch):
                if running is not None and not runner.stages_ahead:
                    finished, running = running, None
                    if not _answer(batches, runner, outbox, finished, waiter):
                        break
                staged = batches.stage(runner, message)
                if running is not None:
                    finished, running = running, None
                    if not _answer(batches, runner, outbox, finished, waiter):
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
        self._batches: queue.SimpleQueue[StagedBatch | None] = queue.SimpleQueue()
        self._pending = 0
        self._thread = threading.Thread(target=self._run, name="geserve-device-wait", daemon=True)
        self._thread.start()

    def watch(self, batch: StagedBatch) -> None:
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
    batches: _ShmBatchRunner, runner: InstanceRunner, outbox: Outbox, running: _Running, waiter: _DeviceWaiter | None
) -> bool:
    """Finish a batch and send its answer; False when the device failed under it and the worker must go."""
    if waiter is not None:
        waiter.take()
    requests = running.message.requests
    placed = batches.finish(runner, running, outbox.emitter(requests) if requests else None)
    try:
        outbox.send(placed)
    except GeserveError as refused:  # over the channel's limit (the model's response parameters): nothing was sent
        _refuse(outbox, placed, running.message, refused)
    if runner.fault:
        # A failed device taints everything this process holds on it: a fresh worker takes over.
        outbox.send(Retiring(runner.fault))
        return False
    return True


def _unlink_all(names: tuple[str, ...]) -> None:
    for name in names:
        unlink_quietly(name)


def _refuse(outbox: Outbox, placed: BatchPlaced, message: RunBatch, refused: GeserveError) -> None:
    """Answer a batch whose answer is too large to send with that error for each of its requests; an output
    overflow segment the worker made for it is unlinked, as nobody will read it (the arena is the front-end's)."""
    for segment in {ref.segment for ref in placed.blocks}:
        if segment == message.output_overflow:
            unlink_quietly(segment)
    errors = tuple(refused for _ in placed.results)
    outbox.send(BatchPlaced(placed.batch_id, (), errors, placed.infer_start_ns, placed.infer_end_ns))
