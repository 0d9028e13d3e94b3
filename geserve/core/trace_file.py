"""Triton's trace file: one JSON array of trace objects in PATH, or one in PATH.<n> per `log_frequency` traces."""

from __future__ import annotations

import logging
import queue
import threading
from typing import BinaryIO

import orjson

from geserve.types import TraceRecord

logger = logging.getLogger(__name__)


def trace_objects(record: TraceRecord) -> bytes:
    """One trace as Triton writes it, without the array's brackets: the object naming its model, then one
    object per timestamp, every one carrying the trace's id; then its children's (an ensemble's steps)."""
    head: dict[str, object] = {"id": record.id, "model_name": record.model_name}
    # Triton writes the version it ran as a number.
    head["model_version"] = int(record.model_version) if record.model_version.isdigit() else record.model_version
    if record.request_id:
        head["request_id"] = record.request_id
    if record.parent_id:
        head["parent_id"] = record.parent_id
    parts = [orjson.dumps(head)]
    parts.extend(
        orjson.dumps({"id": record.id, "timestamps": [{"name": name, "ns": ns}]}) for name, ns in record.timestamps
    )
    parts.extend(trace_objects(child) for child in record.children)
    return b",".join(parts)


# A write for the thread: the index of the PATH.<n> file (None: PATH itself) and the traces, or None to close.
_Job = tuple[int | None, bytes] | None


class TraceFile:
    """PATH and its indexed siblings, written by one thread of their own so that the event loop never waits
    on the disk. PATH opens with '[' at its first traces and closes with ']' when the server stops; each
    PATH.<n> is a whole array at once. Indexes count from 0, as Triton's."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._next_index = 0
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._handle: BinaryIO | None = None  # PATH, once opened; only the writing thread touches it
        self._closed = False

    def save(self, traces: list[bytes], indexed: bool) -> None:
        """Queue `traces` (each from trace_objects) for PATH, or for the next PATH.<n> when `indexed`."""
        if not traces:
            return
        if self._closed:  # PATH is a whole array already: reopening it would truncate it
            logger.warning("%d trace(s) finished after the trace file was closed were not written", len(traces))
            return
        index = None
        if indexed:
            index, self._next_index = self._next_index, self._next_index + 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._write_all, name="geserve-trace-file", daemon=True)
            self._thread.start()
        self._jobs.put((index, b",".join(traces)))

    def close(self) -> None:
        """Write what is queued and end PATH's array; blocks until the thread is done."""
        self._closed = True
        if self._thread is None:
            return
        self._jobs.put(None)
        self._thread.join()
        self._thread = None

    def _write_all(self) -> None:
        while (job := self._jobs.get()) is not None:
            index, body = job
            try:
                self._write(index, body)
            except OSError as error:
                logger.error("failed creating trace file: %s", error)
        if self._handle is not None:
            try:
                self._handle.write(b"]")
                self._handle.close()
            except OSError as error:
                logger.error("failed creating trace file: %s", error)
            self._handle = None

    def _write(self, index: int | None, body: bytes) -> None:
        if index is not None:
            with open(f"{self.path}.{index}", "wb") as indexed:
                indexed.write(b"[" + body + b"]")
            return
        if self._handle is None:
            self._handle = open(self.path, "wb")  # noqa: SIM115 - stays open until the server stops
            self._handle.write(b"[")
        else:
            self._handle.write(b",")
        self._handle.write(body)
        self._handle.flush()


class TraceCollection:
    """The traces of one trace setting, kept until they are written, as Triton's: every `log_frequency`
    traces to the next PATH.<n>; all of them there once the setting's `count` traces are collected; the rest
    when the setting is replaced or the server stops (to PATH, or PATH.<n> when `log_frequency` is set)."""

    def __init__(self, file: TraceFile, log_frequency: int) -> None:
        self._file = file
        self._log_frequency = log_frequency
        self._pending: list[bytes] = []
        self.created = 0  # traces sampled under this setting
        self._collected = 0

    def add(self, record: TraceRecord, count_exhausted: bool) -> None:
        """One finished trace; `count_exhausted` once the setting's count allows no more traces."""
        self._pending.append(trace_objects(record))
        self._collected += 1
        every_trace_in = count_exhausted and self._collected >= self.created
        if every_trace_in or (self._log_frequency and len(self._pending) >= self._log_frequency):
            self._file.save(self._pending, indexed=True)
            self._pending = []

    def flush(self) -> None:
        self._file.save(self._pending, indexed=self._log_frequency != 0)
        self._pending = []
