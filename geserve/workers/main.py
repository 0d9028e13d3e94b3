"""Worker process entry point: one model instance, batches in shared memory, control over a pipe."""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import signal
import sys
import threading
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection

from geserve import log_records
from geserve.backends.base import ResponseEmitter
from geserve.errors import GeserveError, ModelLoadError, UnavailableError
from geserve.residency import Kind, Residency, SharedTensor, gather, torn_rows, unreadable_rows, zeroed
from geserve.types import response_parameters
from geserve.workers.lineage import GROUP_SIGNALS, watch_parent
from geserve.workers.mailbox import Inbox, Outbox
from geserve.workers.messages import (
    BatchPlaced,
    InstanceSpec,
    Loaded,
    LoadFailed,
    OutputBlock,
    ReadStatus,
    Retiring,
    RunBatch,
    Shutdown,
    StatusReport,
)
from geserve.workers.output_arena import InPlaceOutputs, OutputArena
from geserve.workers.output_blocks import OutputBlocks
from geserve.workers.runner import InstanceRunner, StagedBatch
from geserve.workers.runs import RunId
from geserve.workers.shm import TensorLayout, TensorRef, attach_segment, buffer_of, unlink_quietly

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Running:
    """A batch the worker has staged or launched; `refused`: requests whose inputs could not be read (a client's
    region shrunk or replaced since the front door checked it), run as zeros and answered with their own error."""

    message: RunBatch
    batch: StagedBatch
    refused: dict[int, GeserveError] = field(default_factory=dict)


class _ShmBatchRunner:
    """Runs the batches RunBatch messages describe through shared memory: gathers their inputs from where the
    requests' rows lie (each segment mapped once), stages them on the instance runner, and leaves their outputs in
    the output arena, held until released (or in one-off segments when they do not fit)."""

    def __init__(self, spec: InstanceSpec) -> None:
        self.outputs = OutputArena(spec.output_arena)
        self._run = spec.run or RunId.current()

    def stage(self, runner: InstanceRunner, message: RunBatch) -> _Running:
        """Gather a batch's inputs and stage it (a pipelined backend copies them to the device now, while the batch
        before it may still run). A request whose client region can no longer be read fails alone: its rows run as
        zeros and the rest of the batch is served."""
        try:
            return _Running(message, self._staged(runner, message))
        except (GeserveError, OSError, ValueError) as error:  # a segment gone, a client's region shrunk
            failure: Exception = error
            refused = _unreadable(message)
            if refused and len(refused) < len(message.requests):
                try:
                    return _Running(message, self._staged(runner, _zeroed(message, refused)), refused)
                except (GeserveError, OSError, ValueError) as again:
                    failure = again
            return _Running(message, runner.failed_batch(failure, message.output_names, message.requests))

    @staticmethod
    def _staged(runner: InstanceRunner, message: RunBatch) -> StagedBatch:
        if runner.gathers:  # the backend copies each request's rows from where they lie to the device
            blocks = {name: [part.in_place() for part in parts] for name, _, parts in message.inputs}
            return runner.stage_blocks(blocks, message.output_names, message.requests)
        inputs = {name: gather(parts, datatype) for name, datatype, parts in message.inputs}
        return runner.stage(inputs, message.output_names, message.requests)

    def finish(self, runner: InstanceRunner, running: _Running, emit: ResponseEmitter | None = None) -> BatchPlaced:
        """Wait for (or run) a staged batch and place its outputs in shared memory."""
        message = running.message
        in_place = InPlaceOutputs(self.outputs, message.batch_id)
        result, whole = runner.finish(running.batch, in_place.allocate, emit, split=False)
        running.batch.inputs = {}
        # Inputs viewed in a client's region that shrank while they were read ran as zeros: answered with an error.
        running.refused.update(torn_rows([parts for _, _, parts in message.inputs], len(message.requests)))
        blocks = OutputBlocks(runner.output_datatypes, in_place)
        try:
            placed = blocks.place(result.results, whole, message.requests)
            if running.refused:
                placed = tuple(running.refused.get(index, own) for index, own in enumerate(placed))
            blocks.written(self._write(blocks.layout, message.batch_id))
        except (GeserveError, OSError) as error:  # the outputs do not fit in /dev/shm: every request fails
            if isinstance(error, OSError):
                error = UnavailableError(f"the batch's outputs cannot be placed in shared memory: {error}")
            self.outputs.release((message.batch_id,))
            blocks, placed = OutputBlocks(runner.output_datatypes, in_place), (error,) * len(message.requests)
        parameters = tuple(response_parameters(outcome) for outcome in result.results)
        kept = parameters if any(parameters) else ()
        refs = blocks.refs()
        if not refs:  # nobody will release a batch no output of which is read (its backend may have been given some)
            self.outputs.release((message.batch_id,))
        return BatchPlaced(message.batch_id, refs, placed, result.infer_start_ns, result.infer_end_ns, kept)

    def _write(self, layout: TensorLayout, batch_id: int) -> tuple[OutputBlock, ...]:
        """Copy the outputs the backend did not write in place into the arena, or into a one-off segment when no
        region of the arena is large enough."""
        if not layout.count:
            return ()
        offset = self.outputs.allocate(batch_id, layout.size)
        if offset is not None:
            return _blocks(layout.write(memoryview(self.outputs.mapping), self.outputs.name, offset), Kind.ARENA)
        name = self._run.segment_name("out")
        self.outputs.one_off(batch_id, name, layout.size)
        segment = attach_segment(name)
        try:
            return _blocks(layout.write(buffer_of(segment), name), Kind.ONE_OFF)
        finally:
            segment.close()


def _unreadable(message: RunBatch) -> dict[int, GeserveError]:
    return unreadable_rows([parts for _, _, parts in message.inputs], len(message.requests))


def _zeroed(message: RunBatch, refused: dict[int, GeserveError]) -> RunBatch:
    """The batch with the refused requests' inputs as zeros of their shapes."""
    inputs = tuple((name, datatype, zeroed(parts, refused)) for name, datatype, parts in message.inputs)
    return replace(message, inputs=inputs)


def _blocks(refs: tuple[TensorRef, ...], kind: Kind) -> tuple[OutputBlock, ...]:
    """Tensors the layout wrote, as output blocks of the segment kind they were written to."""
    return tuple(
        (ref.name, SharedTensor(ref.datatype, ref.shape, Residency(kind, ref.segment, ref.offset, ref.nbytes)))
        for ref in refs
    )


def run_worker(connection: Connection, spec: InstanceSpec) -> None:
    """Serve one instance until Shutdown or until the front-end's end of the pipe closes."""
    # Ctrl-C and a service manager's SIGTERM reach the whole process group; the server decides when workers stop
    # (a Shutdown message, or its end of the pipe closing).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Blocked while the process started (lineage.start_shielded): ignored now, pending ones are discarded.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, GROUP_SIGNALS)
    os.environ.update(dict(spec.environment))  # before the backend is imported
    # The model's process surface is Triton's stub's, whose embedded interpreter has sys.argv == [''] (pybind11's
    # scoped_interpreter without arguments): a model that parses its command line (unittest.main, argparse) sees
    # none, not the server's.
    sys.argv = [""]
    tags: dict[str, str | int] = {
        "model": spec.model_name,
        "version": str(spec.model_version),
        "instance": spec.instance_name,
        "device": spec.device_id,
        "pid": os.getpid(),
    }
    log_records.log_to(spec.log_file, spec.log_level, spec.log_format, tags, label="worker")
    # A front-end killed outright while this worker's model is stuck: nobody else removes the arenas.
    watch_parent(lambda: _unlink_all((*spec.arenas, spec.output_arena)))
    runner = InstanceRunner(spec)
    # Started by hand (not by a ProcessWorker), the worker is the top of its own run.
    outbox = Outbox(connection, spec.run or RunId.current())
    inboxes: list[Inbox] = []

    try:
        batches = _ShmBatchRunner(spec)
    except OSError as error:
        outbox.send(LoadFailed(f"instance '{spec.instance_name}' cannot map its shared memory: {error}"))
        return

    def open_inbox(threaded: bool) -> None:
        # Before the model's initialize runs: it may wait for the server's answers (BLS, load_model).
        inboxes.append(
            Inbox(
                connection, runner.cancelled, outbox, threaded, release=batches.outputs.release, loading=spec.model_name
            )
        )

    try:
        config = runner.load(open_inbox)
    except ModelLoadError as error:
        outbox.send(LoadFailed(error.message))
        return
    except OSError as error:
        outbox.send(LoadFailed(f"instance '{spec.instance_name}' cannot map its shared memory: {error}"))
        return
    inbox = (
        inboxes[0] if inboxes else Inbox(connection, runner.cancelled, outbox, False, release=batches.outputs.release)
    )
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
                _unlink_all((*spec.arenas, spec.output_arena))
                break
            if message is None:
                continue
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
        batches.outputs.release_all()
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
        _refuse(outbox, placed, refused, batches.outputs)
    if runner.fault:
        # A failed device taints everything this process holds on it: a fresh worker takes over.
        outbox.send(Retiring(runner.fault))
        return False
    return True


def _unlink_all(names: tuple[str, ...]) -> None:
    for name in names:
        unlink_quietly(name)


def _refuse(outbox: Outbox, placed: BatchPlaced, refused: GeserveError, outputs: OutputArena) -> None:
    """Answer a batch whose answer is too large to send with that error for each of its requests; its outputs are
    released at once, as nobody will read them."""
    outputs.release((placed.batch_id,))
    errors = tuple(refused for _ in placed.results)
    outbox.send(BatchPlaced(placed.batch_id, (), errors, placed.infer_start_ns, placed.infer_end_ns))
