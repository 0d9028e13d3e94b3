"""The system shared-memory extension: client regions, registered by key, bounds-checked on every use."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from geserve.errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    UnavailableError,
    UnsupportedError,
)
from geserve.residency import Kind, Residency, SharedTensor
from geserve.settings import DEFAULT_CLIENT_SHM_BYTES, DEFAULT_CLIENT_SHM_REGIONS
from geserve.snapshots import RegionView
from geserve.types import Parameters

DISABLED = "Client shared memory is disabled. Start the server with '--allow-client-shm=true' to enable."
CUDA_UNSUPPORTED = "CUDA shared memory is not supported by geserve: it has no CUDA devices"
# Triton's python-backend prefix: never registrable by clients (nor are the server's own segments).
TRITON_PYTHON_PREFIX = "triton_python_backend_shm_region_"
REGION = "shared_memory_region"
BYTE_SIZE = "shared_memory_byte_size"
OFFSET = "shared_memory_offset"
# Where POSIX shared memory lives on Linux: shm_open("/key") opens SHM_DIRECTORY/key.
SHM_DIRECTORY = "/dev/shm"


@dataclass(frozen=True, slots=True)
class RegionLimits:
    """What the registered regions may hold together (--max-client-shm-regions, --max-client-shm-bytes). Triton
    has no such cap: it maps each region and closes the descriptor, so there it is the kernel's mapping count
    (vm.max_map_count) that runs out. Here each region keeps its descriptor open, and 20,000 of them would leave
    none for connections, model files and workers."""

    regions: int = DEFAULT_CLIENT_SHM_REGIONS
    byte_size: int = DEFAULT_CLIENT_SHM_BYTES


@dataclass(slots=True)
class _Region:
    """A registered region. The segment is read and written through its file descriptor, never
    through a mapping: a client that shrinks its segment would turn a read of mapped memory past the
    new end into SIGBUS in this process, while pread/pwrite just come up short."""

    name: str
    key: str
    offset: int
    byte_size: int
    fd: int
    path: str
    inode: int


def _integer(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{what} must be an integer, got {value!r}")
    return value


class _Regions:
    """Registered regions by name, and tensors read from and written to them through their files, bounds-checked on
    every use (the engine's registry, or a protocol process's mirror of it)."""

    def __init__(self) -> None:
        self._regions: dict[str, _Region] = {}
        self._lock = threading.Lock()  # reads and writes of large tensors run on worker threads

    def __contains__(self, name: object) -> bool:
        return name in self._regions

    # -- tensors in regions --------------------------------------------------------------------

    def _span(self, parameters: Parameters, what: str) -> tuple[_Region, int, int]:
        """The region and the absolute (start, size) a tensor's parameters name, checked against the
        region and the mapped segment."""
        name = parameters.get(REGION)
        if not isinstance(name, str):
            raise InvalidArgumentError(f"{what}: '{REGION}' must be a string")
        if BYTE_SIZE not in parameters:
            raise InvalidArgumentError(f"{what}: '{BYTE_SIZE}' is required with '{REGION}'")
        size = _integer(parameters[BYTE_SIZE], f"{what}: '{BYTE_SIZE}'")
        offset = _integer(parameters.get(OFFSET, 0), f"{what}: '{OFFSET}'")
        region = self._regions.get(name)
        if region is None:
            raise InvalidArgumentError(f"Unable to find system shared memory region: '{name}'")
        if offset < 0 or offset > region.byte_size:
            raise InvalidArgumentError(f"Invalid offset for shared memory region: '{name}'")
        if size < 0 or offset + size > region.byte_size:
            raise InvalidArgumentError(f"Invalid offset + byte size for shared memory region: '{name}'")
        start = region.offset + offset
        _check_segment(region, start + size)
        return region, start, size

    def locate(self, parameters: Parameters, what: str, check: Callable[[int], None] | None = None) -> SharedTensor:
        """Where an input's bytes lie in its region, for a worker to read them there: no byte is read here. `check`
        sees the byte size once the region and the bounds are checked. (Datatype and shape are the caller's.)"""
        with self._lock:
            region, start, size = self._span(parameters, what)
            if check is not None:
                check(size)
            where = Residency(Kind.CLIENT, region.key.lstrip("/"), start, size, region.inode, region.name)
            return SharedTensor("UINT8", (size,), where)

    def read(self, parameters: Parameters, what: str, check: Callable[[int], None] | None = None) -> memoryview:
        """A copy of an input's bytes: the client may rewrite or unregister the region meanwhile. `check` sees the
        byte size once the region and the bounds are checked, and may refuse it before anything is read."""
        with self._lock:
            region, start, size = self._span(parameters, what)
            if check is not None:
                check(size)
            data = os.pread(region.fd, size, start) if size else b""
            if len(data) != size:  # shrunk between the check and the read
                raise _shrunk(region, os.fstat(region.fd).st_size, start + size)
            return memoryview(data)

    def write(self, parameters: Parameters, what: str, data: bytes | memoryview) -> int:
        """Copy an output into its region; returns the bytes written."""
        with self._lock:
            region, start, size = self._span(parameters, what)
            if len(data) > size:
                raise InvalidArgumentError(
                    f"shared memory size specified with the request for {what} ({size} bytes) should be at least "
                    f"{len(data)} bytes to hold the results"
                )
            view = memoryview(data).cast("B")
            written = 0
            while written < len(view):
                written += os.pwrite(region.fd, view[written:], start + written)
            return written


class SharedMemoryManager(_Regions):
    """Regions clients registered; off unless the server was started with --allow-client-shm=true. `views` tells
    what is registered, as protocol processes mirror it."""

    def __init__(
        self, allowed: bool = False, reserved_prefixes: tuple[str, ...] = (), limits: RegionLimits | None = None
    ) -> None:
        super().__init__()
        self.allowed = allowed
        self.limits = limits or RegionLimits()
        self._reserved = (TRITON_PYTHON_PREFIX, *reserved_prefixes)
        # Called after every registration and unregistration: protocol processes hear of it.
        self.on_change: list[Callable[[], None]] = []

    def _changed(self) -> None:
        for listener in self.on_change:
            listener()

    def views(self) -> tuple[RegionView, ...]:
        """Every registered region, as a protocol process's mirror takes them."""
        with self._lock:
            return tuple(
                RegionView(r.name, r.key.lstrip("/"), r.offset, r.byte_size, r.inode) for r in self._regions.values()
            )

    def status(self, name: str = "") -> list[dict[str, Any]]:
        with self._lock:
            if name:
                region = self._regions.get(name)
                if region is None:
                    raise InvalidArgumentError(f"Unable to find system shared memory region: '{name}'")
                regions = [region]
            else:
                regions = list(self._regions.values())
        return [{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size} for r in regions]

    def register(self, name: str, key: Any, offset: Any, byte_size: Any) -> None:
        if not self.allowed:
            raise UnavailableError(DISABLED)
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError("failed to register shared memory region: a region name is required")
        if not isinstance(key, str):
            raise InvalidArgumentError(f"failed to register shared memory region '{name}': invalid args")
        offset = _integer(offset, "'offset'")
        byte_size = _integer(byte_size, "'byte_size'")
        stripped = key.lstrip("/")
        if not stripped or "/" in stripped or "\x00" in stripped or stripped in (".", ".."):
            raise InvalidArgumentError(f"cannot register shared memory region '{name}' - invalid shm key '{key}'")
        for prefix in self._reserved:
            if stripped.startswith(prefix):
                raise InvalidArgumentError(
                    f"cannot register shared memory region '{name}' with key '{key}' as the key contains the "
                    f"reserved prefix '{prefix}'"
                )
        with self._lock:
            if name in self._regions:
                raise AlreadyExistsError(f"shared memory region '{name}' already in manager")
            path = os.path.join(SHM_DIRECTORY, stripped)
            try:
                # As shm_open does: no symlinks (the directory is world-writable), close on exec.
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError as error:
                if error.errno in (errno.EMFILE, errno.ENFILE):
                    raise UnavailableError(
                        f"cannot register shared memory region '{name}': the server has no file descriptor left "
                        f"({len(self._regions)} regions are registered)"
                    ) from None
                raise InvalidArgumentError(f"Unable to open shared memory region: '{key}'") from None
            except ValueError:
                raise InvalidArgumentError(f"Unable to open shared memory region: '{key}'") from None
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or offset < 0 or byte_size <= 0 or offset + byte_size > info.st_size:
                os.close(fd)
                raise InvalidArgumentError(f"failed to register shared memory region '{name}': invalid args")
            try:  # after Triton's own checks, so a bad region gets Triton's answer
                self._check_limits(name, byte_size)
            except InvalidArgumentError:
                os.close(fd)
                raise
            self._regions[name] = _Region(name, key, offset, byte_size, fd, path, info.st_ino)
        self._changed()

    def _check_limits(self, name: str, byte_size: int) -> None:
        """Refuse a region past the caps (called holding the lock), naming the flag that sets each."""
        limits = self.limits
        if len(self._regions) >= limits.regions:
            raise InvalidArgumentError(
                f"cannot register shared memory region '{name}': {len(self._regions)} regions are registered, the "
                f"most --max-client-shm-regions allows; unregister one first"
            )
        registered = sum(region.byte_size for region in self._regions.values())
        if byte_size > 0 and registered + byte_size > limits.byte_size:
            raise InvalidArgumentError(
                f"cannot register shared memory region '{name}': its {byte_size} bytes, with the {registered} bytes "
                f"registered already, would exceed --max-client-shm-bytes ({limits.byte_size})"
            )

    def unregister(self, name: str = "") -> None:
        """One region, or all of them when `name` is empty; an unknown name is not an error."""
        if not self.allowed:
            raise UnavailableError(DISABLED)
        with self._lock:
            names = [name] if name else list(self._regions)
            for item in names:
                region = self._regions.pop(item, None)
                if region is not None:
                    with contextlib.suppress(OSError):
                        os.close(region.fd)
        self._changed()

    def close(self) -> None:
        if self.allowed:
            self.unregister()


class RegionMirror(_Regions):
    """A protocol process's copy of the engine's registry (the engine pushes every change): requests name regions
    registered over any connection, and this process reads and writes them through files of its own."""

    def apply(self, views: tuple[RegionView, ...]) -> None:
        """The registry as it is now: regions gone are let go, new ones opened (one that cannot be opened is left
        out: a request naming it is refused as unregistered)."""
        wanted = {view.name: view for view in views}
        with self._lock:
            for name in [name for name, region in self._regions.items() if _stale(region, wanted.get(name))]:
                with contextlib.suppress(OSError):
                    os.close(self._regions.pop(name).fd)
            for name, view in wanted.items():
                if name not in self._regions:
                    region = _open_view(view)
                    if region is not None:
                        self._regions[name] = region

    def close(self) -> None:
        self.apply(())


def _stale(region: _Region, view: RegionView | None) -> bool:
    return view is None or (view.key, view.offset, view.byte_size, view.inode) != (
        region.key.lstrip("/"),
        region.offset,
        region.byte_size,
        region.inode,
    )


def _open_view(view: RegionView) -> _Region | None:
    path = os.path.join(SHM_DIRECTORY, view.key)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    if os.fstat(fd).st_ino != view.inode:
        os.close(fd)
        return None
    return _Region(view.name, view.key, view.offset, view.byte_size, fd, path, view.inode)


def _check_segment(region: _Region, end: int) -> None:
    """The segment behind `region` still exists, is the one registered, and holds `end` bytes."""
    try:
        current = os.stat(region.path, follow_symlinks=False)
    except OSError:
        raise InvalidArgumentError(
            f"shared memory region '{region.name}' no longer exists: its segment '{region.key}' was removed"
        ) from None
    if current.st_ino != region.inode:
        raise InvalidArgumentError(
            f"shared memory region '{region.name}' was replaced: '{region.key}' is another segment than the one "
            "registered; register it again"
        )
    size = os.fstat(region.fd).st_size
    if size < end:
        raise _shrunk(region, size, end)


def _shrunk(region: _Region, size: int, end: int) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"shared memory region '{region.name}' shrank to {size} bytes: its segment '{region.key}' no longer "
        f"holds the {end} bytes the request uses"
    )


class CudaSharedMemory:
    """The CUDA shared-memory extension exists for clients that probe it: status answers empty,
    unregister succeeds, register is unsupported (no CUDA devices here)."""

    def status(self, name: str = "") -> list[dict[str, Any]]:
        if name:
            raise InvalidArgumentError(f"Unable to find cuda shared memory region: '{name}'")
        return []

    def register(self) -> None:
        raise UnsupportedError(CUDA_UNSUPPORTED)

    def unregister(self, name: str = "") -> None:
        return None
