"""Worker process entry point: one model instance, batches in shared memory, control over a pipe."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Mapping
from multiprocessing import shared_memory
from multiprocessing.connection import Connection

import numpy as np

from geserve.backends.base import RequestResult, ResponseEmitter
from geserve.codecs import dtypes
from geserve.errors import GeserveError, ModelLoadError
from geserve.workers.messages import (
    BatchPlaced,
    Cancel,
    InstanceSpec,
    Loaded,
    LoadFailed,
    Partial,
    PlacedResult,
    ReadStatus,
    RequestInfo,
    Retiring,
    RunBatch,
    Shutdown,
    StatusReport,
)
from geserve.workers.runner import InstanceRunner
from geserve.workers.shm import (
    OutputPlacement,
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

# Streamed responses up to this size travel in the message itself; larger ones in a segment.
_INLINE_BYTES = 64 << 10


class _Segments:
    """The worker's arenas (attached once), and the one-off segments of batches too large for them."""

    def __init__(self, spec: InstanceSpec) -> None:
        self.arenas = {name: attach_segment(name) for name in spec.arenas}

    def run(self, runner: InstanceRunner, message: RunBatch, emit: ResponseEmitter | None = None) -> BatchPlaced:
        extra: dict[str, shared_memory.SharedMemory] = {}
        try:
            for ref in message.inputs:
                if ref.segment not in self.arenas and ref.segment not in extra:
                    extra[ref.segment] = attach_segment(ref.segment)
            inputs = {
                ref.name: read_tensor(buffer_of(self.arenas.get(ref.segment) or extra[ref.segment]), ref)
                for ref in message.inputs
            }
            placement = OutputPlacement(buffer_of(self.arenas[message.output_arena]), message.output_arena)
            result = runner.execute(inputs, message.output_names, message.requests, placement.allocate, emit)
            del inputs
            try:
                placed = self._place(result.results, message, runner.output_datatypes, placement)
            except GeserveError as error:
                placed = (error,) * len(message.requests)
            return BatchPlaced(message.batch_id, placed, result.infer_start_ns, result.infer_end_ns)
        finally:
            for segment in extra.values():
                with contextlib.suppress(BufferError):  # a backend may still hold a view; the OS cleans up
                    segment.close()

    def _place(
        self,
        results: tuple[RequestResult, ...],
        message: RunBatch,
        datatypes: dict[str, str],
        placement: OutputPlacement,
    ) -> tuple[PlacedResult, ...]:
        """Refs to every request's outputs: rows the backend wrote in place are referred to where they
        lie; the rest are laid out after them, one request after another."""
        layout = TensorLayout()
        planned: list[list[TensorRef | int] | GeserveError] = []
        for result in results:
            if isinstance(result, GeserveError):
                planned.append(result)
                continue
            entries: list[TensorRef | int] = []
            for name, array in result.items():
                ref = placement.ref_of(name, array)
                if ref is None:
                    entries.append(layout.count)
                    layout.add(name, datatypes.get(name) or dtypes.from_numpy(array.dtype).wire, [array])
                else:
                    entries.append(ref)
            planned.append(entries)
        written: tuple[TensorRef, ...] = ()
        if layout.count:
            written = self._write(layout, message.output_arena, message.output_overflow, placement.end)
        return tuple(
            entries if isinstance(entries, GeserveError)
            else tuple(entry if isinstance(entry, TensorRef) else written[entry] for entry in entries)
            for entries in planned
        )  # fmt: skip

    def _write(self, layout: TensorLayout, arena_name: str, overflow_name: str, start: int) -> tuple[TensorRef, ...]:
        arena = self.arenas[arena_name]
        if start + layout.size <= arena.size:
            return layout.write(buffer_of(arena), arena_name, start)
        # Too large for the arena: a segment of its own, which the front-end unlinks after reading.
        segment = create_segment(overflow_name, layout.size)
        try:
            return layout.write(buffer_of(segment), overflow_name)
        finally:
            segment.close()


class _Outbox:
    """The pipe to the front-end. Streamed responses may come from a model's own threads while the main
    loop answers batches, so sends are serialized."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
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

    @staticmethod
    def _partial(
        stream_id: int, outputs: Mapping[str, np.ndarray] | None, error: GeserveError | None, final: bool
    ) -> Partial:
        if not outputs:
            return Partial(stream_id, None, (), error, final)
        arrays = {name: np.asarray(array) for name, array in outputs.items()}
        if sum(array.nbytes for array in arrays.values()) <= _INLINE_BYTES:
            return Partial(stream_id, arrays, (), error, final)
        layout = TensorLayout()
        for name, array in arrays.items():
            layout.add(name, dtypes.from_numpy(array.dtype).wire, [array])
        segment = create_segment(segment_name("stream"), layout.size)
        try:
            refs = layout.write(buffer_of(segment), segment.name)
        finally:
            segment.close()
        return Partial(stream_id, None, refs, error, final)


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
    outbox = _Outbox(connection)
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
    try:
        while True:
            try:
                message = connection.recv()
            except EOFError:
                # The front-end is gone without a Shutdown (killed): nobody else will remove the arenas.
                for name in spec.arenas:
                    unlink_quietly(name)
                break
            if isinstance(message, Shutdown):
                break
            if isinstance(message, RunBatch):
                emit = outbox.emitter(message.requests) if message.requests else None
                outbox.send(segments.run(runner, message, emit))
                if runner.fault:
                    # A failed device taints everything this process holds on it: a fresh worker takes over.
                    outbox.send(Retiring(runner.fault))
                    break
            elif isinstance(message, ReadStatus):
                outbox.send(StatusReport(runner.status()))
            elif isinstance(message, Cancel):
                runner.cancelled_streams.add(message.stream_id)
            else:
                logger.error("ignoring unknown message %r", type(message).__name__)
    finally:
        runner.unload()
        connection.close()
