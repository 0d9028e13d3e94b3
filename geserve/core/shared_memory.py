"""The system shared-memory extension: client regions, registered by key, bounds-checked on every use."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Any

from geserve.errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    UnavailableError,
    UnsupportedError,
)
from geserve.types import Parameters
from geserve.workers.shm import SHM_PREFIX

DISABLED = "Client shared memory is disabled. Start the server with '--allow-client-shm=true' to enable."
CUDA_UNSUPPORTED = "CUDA shared memory is not supported by geserve: it has no CUDA devices"
# Triton's python-backend prefix, and geserve's own worker segments: never registrable by clients.
RESERVED_PREFIXES = ("triton_python_backend_shm_region_", SHM_PREFIX)
REGION = "shared_memory_region"
BYTE_SIZE = "shared_memory_byte_size"
OFFSET = "shared_memory_offset"


@dataclass(slots=True)
class _Region:
    name: str
    key: str
    offset: int
    byte_size: int
    segment: shared_memory.SharedMemory


def _integer(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{what} must be an integer, got {value!r}")
    return value


class SharedMemoryManager:
    """Regions clients registered; off unless the server was started with --allow-client-shm=true."""

    def __init__(self, allowed: bool = False) -> None:
        self.allowed = allowed
        self._regions: dict[str, _Region] = {}
        self._lock = threading.Lock()  # reads and writes of large tensors run on worker threads

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
        for prefix in RESERVED_PREFIXES:
            if stripped.startswith(prefix):
                raise InvalidArgumentError(
                    f"cannot register shared memory region '{name}' with key '{key}' as the key contains the "
                    f"reserved prefix '{prefix}'"
                )
        with self._lock:
            if name in self._regions:
                raise AlreadyExistsError(f"shared memory region '{name}' already in manager")
            try:
                segment = shared_memory.SharedMemory(name=stripped, create=False)
            except (FileNotFoundError, ValueError, OSError):
                raise InvalidArgumentError(f"Unable to open shared memory region: '{key}'") from None
            # The client owns the segment: this process must never unlink it at exit.
            with contextlib.suppress(Exception):
                resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
            if offset < 0 or byte_size <= 0 or offset + byte_size > segment.size:
                segment.close()
                raise InvalidArgumentError(f"failed to register shared memory region '{name}': invalid args")
            self._regions[name] = _Region(name, key, offset, byte_size, segment)

    def unregister(self, name: str = "") -> None:
        """One region, or all of them when `name` is empty; an unknown name is not an error."""
        if not self.allowed:
            raise UnavailableError(DISABLED)
        with self._lock:
            names = [name] if name else list(self._regions)
            for item in names:
                region = self._regions.pop(item, None)
                if region is not None:
                    with contextlib.suppress(BufferError):
                        region.segment.close()

    def close(self) -> None:
        if self.allowed:
            self.unregister()

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
        if size < 0 or offset + size > region.byte_size or region.offset + offset + size > region.segment.size:
            raise InvalidArgumentError(f"Invalid offset + byte size for shared memory region: '{name}'")
        return region, region.offset + offset, size

    def read(self, parameters: Parameters, what: str) -> memoryview:
        """A copy of an input's bytes: the client may rewrite or unregister the region meanwhile."""
        with self._lock:
            region, start, size = self._span(parameters, what)
            buffer = region.segment.buf
            assert buffer is not None
            return memoryview(bytes(buffer[start : start + size]))

    def write(self, parameters: Parameters, what: str, data: bytes | memoryview) -> int:
        """Copy an output into its region; returns the bytes written."""
        with self._lock:
            region, start, size = self._span(parameters, what)
            if len(data) > size:
                raise InvalidArgumentError(
                    f"shared memory size specified with the request for {what} ({size} bytes) should be at least "
                    f"{len(data)} bytes to hold the results"
                )
            buffer = region.segment.buf
            assert buffer is not None
            buffer[start : start + len(data)] = data
            return len(data)


class CudaSharedMemory:
    """The CUDA shared-memory endpoints exist for clients that probe them: status answers empty,
    unregister succeeds, register is unsupported (no CUDA devices here)."""

    def status(self, name: str = "") -> list[dict[str, Any]]:
        if name:
            raise InvalidArgumentError(f"Unable to find cuda shared memory region: '{name}'")
        return []

    def register(self) -> None:
        raise UnsupportedError(CUDA_UNSUPPORTED)

    def unregister(self, name: str = "") -> None:
        return None
