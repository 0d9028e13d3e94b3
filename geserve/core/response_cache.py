"""Triton's response cache (the `local` cache): a byte-bounded LRU of model outputs, keyed by what a request asks."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import sys
import time
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from geserve import log_records
from geserve._generated import model_config_pb2 as mc
from geserve.batching.request import ScheduledRequest, ScheduledResponse
from geserve.errors import ModelLoadError
from geserve.residency import SharedTensor
from geserve.types import CacheSnapshot, Parameters, response_parameters, with_parameters

if TYPE_CHECKING:
    from geserve.core.models import ModelVersion

logger = logging.getLogger(__name__)

FIELD = "response_cache { enable: true }"
# Hashing or copying more than this runs on a thread, so that one large request does not stall the event loop.
OFFLOAD_BYTES = 1 << 20


def enabled(config: mc.ModelConfig) -> bool:
    return config.HasField("response_cache") and config.response_cache.enable


def check_config(config: mc.ModelConfig) -> None:
    """Triton's refusals at load: no response cache for decoupled models, nor for the sequence batcher (whose
    requests depend on the sequence's earlier ones, not only on their inputs)."""
    if not enabled(config):
        return
    if config.model_transaction_policy.decoupled:
        raise ModelLoadError(
            f"Response Cache does not currently support model '{config.name}' with a 'decoupled' transaction policy"
        )
    if config.HasField("sequence_batching"):
        raise ModelLoadError(
            f"Response Cache does not currently support model '{config.name}' with sequence batching: only the "
            "default and the dynamic batcher are eligible for caching"
        )


def check_ensemble_steps(config: mc.ModelConfig, steps: Sequence[mc.ModelConfig]) -> None:
    """An ensemble caches at the top level only when each of its steps could be cached (Triton's rule); `steps`
    are the configs of the versions its steps may run on."""
    if not enabled(config):
        return
    for step in steps:
        if step.model_transaction_policy.decoupled:
            raise ModelLoadError(
                f"Response Cache does not currently support model '{config.name}': its step model '{step.name}' "
                "has a 'decoupled' transaction policy"
            )
        if step.HasField("sequence_batching"):
            raise ModelLoadError(
                f"Response Cache does not currently support model '{config.name}': its step model '{step.name}' "
                "uses sequence batching"
            )


def request_key(model: str, version: int, request: ScheduledRequest, load: int = 0, steps: int = 0) -> bytes:
    """What Triton hashes (model name, version, each input's name and bytes, inputs by name), and also each input's
    datatype and shape, so that the same bytes in another shape are another request, the outputs asked for, since a
    response carries exactly those, and which load of the version it is, so that a reloaded model (new files, same
    version number) is not answered with what the old one computed; for an ensemble, `steps` says which loads of
    its step models it would run on now. A 128-bit digest: collisions are not a concern."""
    digest = hashlib.blake2b(digest_size=16)
    _add(digest, model.encode())
    digest.update(version.to_bytes(8, "little", signed=True))
    digest.update(load.to_bytes(8, "little"))
    digest.update(steps.to_bytes(8, "little"))
    for name in sorted(request.inputs):
        array = request.inputs[name].array
        _add(digest, name.encode())
        _add(digest, array.dtype.str.encode())
        _add(digest, np.asarray(array.shape, dtype=np.int64).tobytes())
        if array.dtype == object:
            for item in array.flat:
                _add(digest, item if isinstance(item, bytes) else str(item).encode())
        else:
            data = np.ascontiguousarray(array)
            _add(digest, data.reshape(-1).view(np.uint8).data)
    for name in sorted(request.output_names):
        _add(digest, name.encode())
    return digest.digest()


def _add(digest: hashlib.blake2b, data: bytes | memoryview) -> None:
    """Length-prefixed, so that ("ab", "c") and ("a", "bc") differ."""
    digest.update(len(data).to_bytes(8, "little"))
    digest.update(data)


# What an entry costs beyond its packed outputs, measured on CPython 3.11: its key (a 16-byte digest as bytes), its
# slot in the OrderedDict (hash table entry and LRU link), the PackedResponse and the layout tuples around them.
_ENTRY_OVERHEAD = sys.getsizeof(bytes(16)) + 104 + 80
_OUTPUT_OVERHEAD = 64 + 56 + 40  # per output: its layout tuple, its shape tuple and its dtype string
_ALIGNMENT = 16


@dataclass(frozen=True, slots=True)
class PackedResponse:
    """Outputs as the cache holds them: every output's data in one read-only buffer and where each lies in it, so
    that an entry costs its bytes and little more, and `cost` says what it costs (names, layout and overheads
    counted, not only the data: an 8 MiB cache of small entries stays near 8 MiB)."""

    blob: bytes
    layout: tuple[tuple[str, str, tuple[int, ...], int, int], ...]  # name, dtype ('|O': BYTES), shape, offset, size
    parameters: Parameters
    cost: int


def pack(outputs: Mapping[str, np.ndarray]) -> PackedResponse:
    """Copy outputs out of the worker's arena (which the next batch overwrites) into one buffer the cache owns;
    BYTES elements are kept length-prefixed, as the binary protocol frames them."""
    pieces: list[bytes | memoryview] = []
    layout = []
    offset = 0
    for name, array in outputs.items():
        if array.dtype == object:
            data = b"".join(
                len(item).to_bytes(4, "little") + item
                for item in (value if isinstance(value, bytes) else str(value).encode() for value in array.flat)
            )
            pieces.append(data)
            size = len(data)
        else:
            contiguous = np.ascontiguousarray(array)
            pieces.append(contiguous.reshape(-1).view(np.uint8).data)
            size = contiguous.nbytes
        layout.append((name, array.dtype.str, tuple(array.shape), offset, size))
        padding = -size % _ALIGNMENT  # each output's data starts aligned, as numpy's own buffers do
        pieces.append(bytes(padding))
        offset += size + padding
    blob = b"".join(pieces)
    cost = sys.getsizeof(blob) + _ENTRY_OVERHEAD + sum(_OUTPUT_OVERHEAD + len(name) for name in outputs)
    return PackedResponse(blob, tuple(layout), response_parameters(outputs), cost)


def unpack(entry: PackedResponse) -> dict[str, np.ndarray]:
    """The outputs of an entry: read-only views of its buffer (BYTES decoded into elements of their own), so that no
    response built from them can change what later hits get."""
    outputs = {}
    for name, dtype, shape, offset, size in entry.layout:
        if dtype == "|O":
            elements = []
            position, end = offset, offset + size
            while position < end:
                length = int.from_bytes(entry.blob[position : position + 4], "little")
                elements.append(entry.blob[position + 4 : position + 4 + length])
                position += 4 + length
            array = np.empty(len(elements), dtype=object)
            array[:] = elements
            array = array.reshape(shape)
            array.flags.writeable = False
        else:
            kind = np.dtype(dtype)
            array = np.frombuffer(entry.blob, dtype=kind, count=size // kind.itemsize, offset=offset).reshape(shape)
        outputs[name] = array
    return with_parameters(outputs, entry.parameters)


async def execute(version: ModelVersion, request: ScheduledRequest, started_ns: int | None = None) -> ScheduledResponse:
    """A request to `version` through the response cache when the version uses it, else straight to its scheduler;
    `started_ns`: when the request arrived (a hit's success duration runs from there)."""
    cache = version.response_cache
    if cache is None:
        return await version.scheduler.execute(request)
    return await cache.execute(version, request, time.monotonic_ns() if started_ns is None else started_ns)


class ResponseCache:
    """One cache for every model that enables it, as Triton's local cache: entries are evicted least recently used
    first until a new one fits; an entry larger than the whole cache is not inserted. Used on the event loop only."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[bytes, PackedResponse] = OrderedDict()
        self.used_bytes = 0
        self.lookups = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.lookup_ns = 0
        self.insertion_ns = 0
        self._too_large_warned: set[str] = set()
        self._loads: weakref.WeakKeyDictionary[ModelVersion, int] = weakref.WeakKeyDictionary()
        self._load_numbers = itertools.count(1)
        # Bumped by every version load: an ensemble's entries hold only until one of its steps may have changed
        # (a step model reloads without its ensemble, or a new version of it serves under model_version -1).
        self._generation = 0

    def note_load(self) -> None:
        """A version of some model loaded: ensembles' entries computed before may no longer be what they would run."""
        self._generation += 1

    def attach(self, version: ModelVersion) -> None:
        """Serve `version` through this cache, with entries of its own (not those of an earlier load of it)."""
        self._loads[version] = next(self._load_numbers)
        version.response_cache = self

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, key: bytes) -> dict[str, SharedTensor] | None:
        started_ns = time.monotonic_ns()
        self.lookups += 1
        found = self._entries.get(key)
        if found is None:
            self.misses += 1
        else:
            self.hits += 1
            self._entries.move_to_end(key)
        self.lookup_ns += time.monotonic_ns() - started_ns
        if found is None:
            return None
        outputs = {name: SharedTensor.local(array) for name, array in unpack(found).items()}
        return with_parameters(outputs, found.parameters)

    def insert(self, key: bytes, entry: PackedResponse) -> bool:
        """Store a packed response under `key`; False when it costs more than the whole cache."""
        started_ns = time.monotonic_ns()
        size = entry.cost
        try:
            if size > self.capacity_bytes:
                return False
            if key in self._entries:  # two identical requests missed at once: the first answer stays
                self._entries.move_to_end(key)
                return True
            while self.used_bytes + size > self.capacity_bytes and self._entries:
                _, evicted = self._entries.popitem(last=False)
                self.used_bytes -= evicted.cost
                self.evictions += 1
            self._entries[key] = entry
            self.used_bytes += size
            return True
        finally:
            self.insertion_ns += time.monotonic_ns() - started_ns

    def snapshot(self) -> CacheSnapshot:
        """The cache-level figures Triton's local cache publishes (nv_cache_num_entries, ...)."""
        return CacheSnapshot(
            len(self._entries),
            self.lookups,
            self.hits,
            self.misses,
            self.evictions,
            self.lookup_ns,
            self.insertion_ns,
            self.used_bytes / self.capacity_bytes,
        )

    async def execute(self, version: ModelVersion, request: ScheduledRequest, started_ns: int) -> ScheduledResponse:
        """The request's outputs from the cache, or from the model (then cached). Statistics as Triton's: a hit is
        a success with no inference nor execution; a miss adds its lookup and insertion time. A failing cache never
        fails the request."""
        lookup_start_ns = time.monotonic_ns()
        try:
            load = self._loads.get(version, 0)
            steps = self._generation if version.config.platform == "ensemble" else 0
            if _total_bytes({name: tensor.array for name, tensor in request.inputs.items()}) > OFFLOAD_BYTES:
                key = await asyncio.to_thread(request_key, version.name, version.version, request, load, steps)
            else:
                key = request_key(version.name, version.version, request, load, steps)
            cached = self.lookup(key)
        except Exception:
            fields = log_records.request_fields(version.name, version.version, request.request_id)
            logger.exception(
                "response cache lookup failed for model '%s'; running the model", version.name, extra=fields
            )
            return await version.scheduler.execute(request)
        lookup_end_ns = time.monotonic_ns()
        if cached is not None:
            version.stats.record_cache_hit(lookup_end_ns - started_ns, lookup_end_ns - lookup_start_ns)
            return ScheduledResponse(cached)
        answered = await version.scheduler.execute(request)
        insert_start_ns = time.monotonic_ns()
        try:
            arrays = with_parameters(
                {name: tensor.array for name, tensor in answered.outputs.items()}, response_parameters(answered.outputs)
            )
            if _total_bytes(arrays) > OFFLOAD_BYTES:
                owned = await asyncio.to_thread(pack, arrays)
            else:
                owned = pack(arrays)
            self._insert_answer(version, key, owned)
        except Exception:
            fields = log_records.request_fields(version.name, version.version, request.request_id)
            logger.exception("response cache insertion failed for model '%s'", version.name, extra=fields)
        miss_ns = (lookup_end_ns - lookup_start_ns) + (time.monotonic_ns() - insert_start_ns)
        version.stats.record_cache_miss(miss_ns)
        return answered

    def _insert_answer(self, version: ModelVersion, key: bytes, owned: PackedResponse) -> None:
        size = owned.cost
        if self.insert(key, owned):
            return
        message = "Failed to insert key into the response cache for model '%s': the entry's %d bytes are more than "
        message += "the cache's %d (--cache-config local,size=...)"
        if version.name in self._too_large_warned:
            logger.debug(message, version.name, size, self.capacity_bytes)
        else:
            self._too_large_warned.add(version.name)
            logger.warning(message, version.name, size, self.capacity_bytes)


# A BYTES tensor with more elements than this counts as large without summing its elements' lengths.
_MANY_ELEMENTS = 4096


def _total_bytes(arrays: Mapping[str, np.ndarray]) -> int:
    """What hashing or copying the arrays reads: a BYTES tensor's nbytes counts its object pointers, not its data."""
    total = 0
    for array in arrays.values():
        if array.dtype != object:
            total += array.nbytes
        elif array.size > _MANY_ELEMENTS:
            return OFFLOAD_BYTES + 1
        else:
            total += sum(len(item) if isinstance(item, bytes | str) else 8 for item in array.flat)
    return total
