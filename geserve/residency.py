"""SharedTensor: a tensor known by its datatype, shape and where its bytes lie, mapped only by a process reading it."""

# A request's tensors cross from the protocol processes to the engine and on to a worker, and a batch's outputs
# back, as descriptors: the engine schedules them without ever mapping their bytes, and each reader maps a
# segment once and views it. Residency (where) is part of the type, not something derived from a segment's name.

from __future__ import annotations

import ctypes
import enum
import math
import mmap
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Container, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from geserve import client_views
from geserve.codecs import bytes as bytes_codec
from geserve.codecs import dtypes
from geserve.errors import GeserveError, InvalidArgumentError, UnavailableError

SHM_DIRECTORY = Path("/dev/shm")
# Segments mapped at once per process; a segment's mapping outlives its eviction while a view of it is alive.
_MAPPED_SEGMENTS = 64
# A client region's tensor of at least this size is viewed in place where it is read for a batch; a smaller one is
# copied. Mapping and unmapping cost about what a copy does at 4 MiB (a copy and a sum of 4 MiB: 1.45 ms copied,
# 1.56 ms viewed; 16 MiB: 8.3 vs 6.5 ms), and the copy is bounded by this size.
VIEW_CLIENT_BYTES = 4 << 20


class Kind(enum.IntEnum):
    """What holds a tensor's bytes, which says who may map it and who removes it."""

    ARENA = 1  # a long-lived segment tensors are allocated in: a request arena or a worker's output arena
    ONE_OFF = 2  # a segment made for one batch or one call, removed by its maker once released
    CLIENT = 3  # a client's registered region: read through its file, or viewed under client_views' guard
    ZEROS = 4  # no bytes anywhere: zeros (empty strings for BYTES), the padding of an empty sequence slot


class Residency(NamedTuple):
    """Where a tensor's bytes lie. A named tuple: every batch carries one per request and input."""

    kind: int
    segment: str  # the segment's name under /dev/shm (a client region's key, without the slash)
    offset: int
    nbytes: int
    inode: int = 0  # a client region: the file registered under the key; another file there is refused
    region: str = ""  # a client region: the name it was registered under, which errors quote


class SharedTensor:
    """A tensor by datatype, shape and residency. Its array is made on first use in the process that asks, as a view
    of the mapped segment (a copy for a client's region); `lease` is whatever keeps the bytes from being reused,
    held by the tensor and by every array viewing it. A tensor without a residency holds this process's array
    (an instance on a thread, a streamed response, a cached one) and crosses to another process by value."""

    __slots__ = ("_array", "datatype", "lease", "shape", "where")

    def __init__(
        self,
        datatype: str,
        shape: tuple[int, ...],
        where: Residency | None,
        *,
        array: np.ndarray | None = None,
        lease: object = None,
    ) -> None:
        self.datatype = datatype
        self.shape = shape
        self.where = where
        self.lease = lease
        self._array = array

    @classmethod
    def local(cls, array: np.ndarray, datatype: str | None = None) -> SharedTensor:
        """An array of this process as a tensor (not shareable)."""
        return cls(datatype or dtypes.from_numpy(array.dtype).wire, tuple(array.shape), None, array=array)

    @classmethod
    def zeros(cls, datatype: str, shape: tuple[int, ...]) -> SharedTensor:
        """Zeros (empty strings for BYTES) of `shape`, with no bytes anywhere until a reader makes them."""
        return cls(datatype, shape, Residency(Kind.ZEROS, "", 0, 0))

    def __repr__(self) -> str:
        return f"SharedTensor({self.datatype}, {self.shape}, {self.where})"

    def __reduce__(self) -> tuple[Any, ...]:
        if self.where is None:
            # Held in this process's memory: it crosses by value (a decoupled model's streamed responses, a response
            # cache's hits); everything a batch answers crosses as where it lies.
            return (_local, (self.array, self.datatype))
        return (SharedTensor, (self.datatype, self.shape, self.where))

    # -- what it is, without reading it ----------------------------------------------------------

    @property
    def dtype(self) -> np.dtype[Any]:
        return dtypes.from_wire(self.datatype).numpy

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """The bytes it takes where it lies (a BYTES tensor: its framed elements)."""
        if self.where is not None and self.where.kind != Kind.ZEROS:
            return self.where.nbytes
        if self._array is not None and self.datatype == "BYTES":
            return len(bytes_codec.serialize(self._array))
        itemsize = dtypes.from_wire(self.datatype).itemsize
        return self.size * (itemsize or 0)

    @property
    def in_shared_memory(self) -> bool:
        """Whether another process can read it (a worker, a protocol process)."""
        return self.where is not None

    def reshaped(self, shape: tuple[int, ...]) -> SharedTensor:
        """The same bytes with another shape of as many elements."""
        array = self._array.reshape(shape) if self._array is not None else None
        return SharedTensor(self.datatype, shape, self.where, array=array, lease=self.lease)

    def rows(self, first: int, count: int) -> SharedTensor:
        """Rows [first, first + count) of the first dimension, in place (not for BYTES, whose rows vary in size)."""
        if first == 0 and self.shape and count == self.shape[0]:
            return self
        shape = (count, *self.shape[1:])
        array = self._array[first : first + count] if self._array is not None else None
        where = self.where
        if where is not None and where.kind != Kind.ZEROS:
            if self.datatype == "BYTES":
                raise ValueError("rows of a BYTES tensor in shared memory cannot be told apart by offset")
            row_bytes = math.prod(self.shape[1:]) * (dtypes.from_wire(self.datatype).itemsize or 0)
            where = where._replace(offset=where.offset + first * row_bytes, nbytes=count * row_bytes)
        return SharedTensor(self.datatype, shape, where, array=array, lease=self.lease)

    # -- its bytes -------------------------------------------------------------------------------

    @property
    def array(self) -> np.ndarray:
        """The tensor as an array of this process, made (mapped, read or decoded) on first use."""
        if self._array is None:
            self._array = _materialize(self)
        return self._array

    def in_place(self) -> np.ndarray:
        """The array, viewed where it lies when it is a large tensor in a client's region rather than copied (the
        worker's way to read a batch's inputs: whoever reads it so asks `torn_rows` afterwards)."""
        where = self.where
        if (
            self._array is None
            and where is not None
            and where.kind == Kind.CLIENT
            and self.datatype != "BYTES"
            and where.nbytes >= VIEW_CLIENT_BYTES
        ):
            viewed = _view_client(where)
            self.lease = viewed
            self._array = viewed.array.view(self.dtype).reshape(self.shape)
        return self.array

    def read_into(self, target: memoryview) -> None:
        """Copy a fixed-size tensor's bytes into `target` (exactly its size): a client region is read straight into
        it, zeros are written, anything else is copied from its mapping."""
        where = self.where
        if where is not None and where.kind == Kind.CLIENT:
            _read_client(where, target)
        elif where is not None and where.kind == Kind.ZEROS:
            np.frombuffer(target, dtype=np.uint8)[:] = 0
        else:
            source = np.ascontiguousarray(self.array).reshape(-1).view(np.uint8)
            np.frombuffer(target, dtype=np.uint8)[:] = source

    def framed(self) -> bytes | memoryview:
        """A BYTES tensor's framed elements as they lie (framed now for one held in this process)."""
        where = self.where
        if where is None:
            return bytes_codec.serialize(self.array)
        if where.kind == Kind.ZEROS:
            return bytes_codec.serialize(np.full(self.shape, b"", dtype=np.object_))
        if where.kind == Kind.CLIENT:
            buffer = bytearray(where.nbytes)
            _read_client(where, memoryview(buffer))
            return memoryview(buffer)
        return memoryview(_view(where, self.lease).data)


def _local(array: np.ndarray, datatype: str) -> SharedTensor:
    return SharedTensor.local(array, datatype)


def gather(parts: Sequence[SharedTensor], datatype: str) -> np.ndarray:
    """The parts' rows one after the other as one array: the only part in place, several copied once into new
    memory (BYTES elements decoded from their framed bytes)."""
    if datatype == "BYTES":
        if len(parts) == 1:
            return parts[0].array
        rows = sum(part.shape[0] for part in parts)
        framed = b"".join(bytes(part.framed()) for part in parts)
        return bytes_codec.deserialize(framed).reshape((rows, *parts[0].shape[1:]))
    if len(parts) == 1 and parts[0].where is not None:
        return parts[0].in_place()
    first = parts[0].shape
    shape = first if len(parts) == 1 else (sum(part.shape[0] for part in parts), *first[1:])
    target = np.empty(shape, dtype=dtypes.from_wire(datatype).numpy)
    flat = target.reshape(-1).view(np.uint8).data
    position = 0
    for part in parts:
        size = part.size * target.itemsize
        part.read_into(flat[position : position + size])
        position += size
    return target


def unreadable_rows(inputs: Sequence[Sequence[SharedTensor]], requests: int) -> dict[int, GeserveError]:
    """The requests of a batch (each input given as one part per request) whose inputs in a client's region cannot
    be read now, with why: the region shrank or was replaced since the front door checked it. A batch laid out
    otherwise is not told apart (empty)."""
    refused: dict[int, GeserveError] = {}
    for parts in inputs:
        if len(parts) != requests:
            return {}
        for index, part in enumerate(parts):
            if index in refused or part.where is None or part.where.kind != Kind.CLIENT:
                continue
            try:
                os.close(_client_file(part.where, checked=True))
            except GeserveError as error:
                refused[index] = error
    return refused


def torn_rows(inputs: Sequence[Sequence[SharedTensor]], requests: int) -> dict[int, GeserveError]:
    """The requests of a batch whose inputs were viewed in a client's region that shrank while they were read
    (they read as zeros), with the error each is answered with instead."""
    torn: dict[int, GeserveError] = {}
    for parts in inputs:
        if len(parts) != requests:
            continue
        for index, part in enumerate(parts):
            where = part.where
            if isinstance(part.lease, client_views.View) and part.lease.torn and where is not None:
                torn[index] = InvalidArgumentError(
                    f"shared memory region '{where.region}' shrank while the request's input was read from it: its "
                    f"segment '/{where.segment}' no longer holds the {where.offset + where.nbytes} bytes the request "
                    "uses"
                )
    return torn


def zeroed(parts: Sequence[SharedTensor], refused: Container[int]) -> tuple[SharedTensor, ...]:
    """The parts with those of the refused requests as zeros of their shapes (their rows run, their answer is
    their error)."""
    return tuple(
        SharedTensor.zeros(part.datatype, part.shape) if index in refused else part for index, part in enumerate(parts)
    )


# -- mappings ------------------------------------------------------------------------------------------


class _Mappings:
    """The arenas this process has mapped, by name; the least recently used is let go past a bound (its mapping
    stays while a view of it lives). Segment names are never reused while geserve runs, so a name maps one file."""

    def __init__(self) -> None:
        self._mapped: OrderedDict[str, mmap.mmap] = OrderedDict()
        self._lock = threading.Lock()  # gRPC's threads and a worker's threads read tensors too

    def of(self, name: str) -> mmap.mmap:
        with self._lock:
            found = self._mapped.get(name)
            if found is not None:
                self._mapped.move_to_end(name)
                return found
        mapping = map_segment(name)
        with self._lock:
            self._mapped[name] = mapping
            while len(self._mapped) > _MAPPED_SEGMENTS:
                self._mapped.popitem(last=False)
        return mapping

    def forget(self, name: str) -> None:
        """Let go of a segment that is gone (removed by its owner): its views keep their memory."""
        with self._lock:
            self._mapped.pop(name, None)

    def names(self) -> list[str]:
        with self._lock:
            return list(self._mapped)


def map_segment(name: str) -> mmap.mmap:
    """The whole segment `name`, mapped; unmapped when the last view of the mapping dies."""
    descriptor = _open(name)
    try:
        return mmap.mmap(descriptor, 0)
    finally:
        os.close(descriptor)


MAPPINGS = _Mappings()


def _open(name: str) -> int:
    try:
        return os.open(SHM_DIRECTORY / name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise UnavailableError(f"shared memory segment '{name}' is gone") from None


def _view(where: Residency, lease: object) -> np.ndarray:
    """A uint8 view of the bytes `where` names, keeping `lease` alive as long as any view of it lives. A one-off
    segment is mapped for its views alone, not kept among the arenas: its owner removes it once released, and a
    mapping left behind would pin its pages."""
    mapping = map_segment(where.segment) if where.kind == Kind.ONE_OFF else MAPPINGS.of(where.segment)
    if where.offset + where.nbytes > len(mapping):
        raise UnavailableError(f"shared memory segment '{where.segment}' is smaller than a tensor in it says")
    if where.nbytes == 0:
        return np.zeros(0, dtype=np.uint8)
    region = (ctypes.c_char * where.nbytes).from_buffer(mapping, where.offset)
    if lease is not None:
        weakref.finalize(region, _hold, lease)  # the finalizer's arguments live as long as the region
    return np.frombuffer(memoryview(region).cast("B"), dtype=np.uint8)


def _hold(lease: object) -> None:
    """Nothing: a finalizer whose only work is to keep its argument alive until its object dies."""


def _materialize(tensor: SharedTensor) -> np.ndarray:
    where = tensor.where
    assert where is not None, "a local tensor has its array"
    if tensor.datatype == "BYTES":
        if where.kind == Kind.ZEROS:
            return np.full(tensor.shape, b"", dtype=np.object_)
        return _decoded(tensor.framed(), tensor)
    dtype = dtypes.from_wire(tensor.datatype).numpy
    if where.kind == Kind.ZEROS:
        return np.zeros(tensor.shape, dtype=dtype)
    if where.kind == Kind.CLIENT:
        target = np.empty(tensor.shape, dtype=dtype)
        _read_client(where, target.reshape(-1).view(np.uint8).data)
        return target
    return _view(where, tensor.lease).view(dtype).reshape(tensor.shape)


def _decoded(framed: bytes | memoryview, tensor: SharedTensor) -> np.ndarray:
    count = tensor.size
    elements = bytes_codec.deserialize(framed, count)
    if len(elements) != count:
        raise InvalidArgumentError(f"expected {count} string elements, got {len(elements)}")
    return elements.reshape(tensor.shape)


def _read_client(where: Residency, target: memoryview) -> None:
    """Read a client region's bytes into `target` through its file: a region shrunk or replaced since it was
    checked comes up short or is another file, an error here rather than SIGBUS in whoever reads a mapping."""
    descriptor = _client_file(where)
    try:
        done = 0
        while done < len(target):
            read = os.preadv(descriptor, [target[done:]], where.offset + done)
            if read <= 0:
                raise _shrunk(where, where.offset + done)
            done += read
    finally:
        os.close(descriptor)


def _view_client(where: Residency) -> client_views.View:
    """A client region's bytes viewed in place, guarded (client_views): no copy, and holes stay free."""
    descriptor = _client_file(where)
    try:
        viewed = client_views.view(descriptor, where.offset, where.nbytes)
    finally:
        os.close(descriptor)
    if isinstance(viewed, client_views.Shortfall):
        raise _shrunk(where, viewed.size)
    return viewed


def _client_file(where: Residency, *, checked: bool = False) -> int:
    """The region's file, open for reading: refused when it is gone or is another file than the one registered
    (and, `checked`, when it no longer holds the tensor's bytes)."""
    try:
        descriptor = os.open(SHM_DIRECTORY / where.segment, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        raise InvalidArgumentError(
            f"shared memory region '{where.region}' is gone: its segment '/{where.segment}' no longer exists"
        ) from None
    try:
        found = os.fstat(descriptor)
        if where.inode and found.st_ino != where.inode:
            raise InvalidArgumentError(
                f"shared memory region '{where.region}' was replaced: '/{where.segment}' is another segment than the "
                "one registered; register it again"
            )
        if checked and found.st_size < where.offset + where.nbytes:
            raise _shrunk(where, found.st_size)
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor


def _shrunk(where: Residency, size: int) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"shared memory region '{where.region}' shrank to {size} bytes: its segment '/{where.segment}' no longer "
        f"holds the {where.offset + where.nbytes} bytes the request uses"
    )


# -- leases ---------------------------------------------------------------------------------------------


class Lease:
    """Holds shared bytes (a batch's outputs, a request's arena blocks) until every tensor and array holding the
    lease is gone; then `release` runs once, on whatever thread let go of the last one."""

    __slots__ = ("__weakref__", "key")

    def __init__(self, key: object, release: Callable[[object], None]) -> None:
        self.key = key
        weakref.finalize(self, release, key)
