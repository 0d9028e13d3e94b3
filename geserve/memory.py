"""The front-end's memory: glibc's malloc set for large tensors, and startup's objects kept from the collector."""

from __future__ import annotations

import asyncio
import ctypes
import functools
import gc
import logging
import os
import platform
from collections.abc import Mapping

logger = logging.getLogger(__name__)

# <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
# glibc's own ceiling for its dynamic mmap threshold on 64-bit: buffers up to this size come from the heap.
MMAP_THRESHOLD = 32 * 1024 * 1024
# Free memory a heap keeps at its top before handing it back: dozens of batches of images in flight.
TRIM_THRESHOLD = 256 * 1024 * 1024
# What a user sets to choose for themselves (glibc reads these at startup); then theirs stand.
USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
# glibc gives each new thread an arena of its own, up to 8 per core. A thread arena's heaps (64 MiB each) never
# shrink below the trim threshold above, and malloc_trim does not shrink their tops: a gRPC thread that received one
# refused 300 MiB message kept two full heaps, +132 MiB for good. With the one main arena, malloc_trim hands it
# back (+2 MiB); the server's threads allocate little outside the GIL, and gRPC at 64 clients measured the same
# throughput and CPU per image either way (8 alternating rounds: 1.00x and 0.97x).
ARENA_MAX = 1


def keep_freed_memory(environ: Mapping[str, str] = os.environ) -> bool:
    """Raise glibc's mmap and trim thresholds for this process; False when nothing changed (not glibc, or
    the environment sets malloc's thresholds itself).

    Left dynamic, glibc follows the last freed mmapped chunk (an image request's 600 KB) and trims the heap
    top beyond twice that, so with many requests in flight each new buffer is faulted in and zeroed again by
    the kernel: 40-60 page faults per image on the gRPC path at 64 concurrent clients, against 7-11 with this.
    """
    if any(name in environ for name in USER_SETTINGS) or "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return False
    if not _glibc():
        return False
    applied = _mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and _mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    logger.debug("malloc thresholds raised: %s", applied)
    return applied


def bound_arenas(environ: Mapping[str, str] = os.environ) -> bool:
    """Cap glibc's malloc arenas for this process (and the processes it forks) at ARENA_MAX; False when nothing
    changed (not glibc, or the environment sets the cap itself). Call it before threads start allocating."""
    if "MALLOC_ARENA_MAX" in environ or "glibc.malloc.arena_max" in environ.get("GLIBC_TUNABLES", ""):
        return False
    if not _glibc():
        return False
    return _mallopt(M_ARENA_MAX, ARENA_MAX)


def _mallopt(option: int, value: int) -> bool:
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(option, value))


# A message this large leaves the process holding what its buffers took (gRPC's receive slices, the parse) until
# something else reuses it: 615 MiB kept after one refused 300 MiB message. Past this, free memory is handed back.
TRIM_AFTER_BYTES = 64 * 1024 * 1024
# After the message's last buffers are let go (the call's objects are dropped once its handler returns).
_TRIM_DELAY_S = 0.5
_trim_pending = False


def trim_soon() -> None:
    """Free what a large message left behind shortly (a collection, then glibc's malloc_trim on a thread: it walks
    the heap), once however many large messages asked for it meanwhile; nothing where the C library is not glibc."""
    global _trim_pending  # noqa: PLW0603 (one pending trim per process)
    if _trim_pending or not _glibc():
        return
    _trim_pending = True
    loop = asyncio.get_running_loop()

    def trim() -> None:
        global _trim_pending  # noqa: PLW0603
        _trim_pending = False
        # A refused message's buffers are often held by a cycle (the error's traceback, its frames' locals), which
        # only a collection frees: they would otherwise stay until the collector next ran through every generation.
        gc.collect()
        loop.run_in_executor(None, _malloc_trim)

    loop.call_later(_TRIM_DELAY_S, trim)


@functools.cache
def _glibc() -> bool:
    # platform.libc_ver reads the interpreter's binary: asked once.
    return platform.libc_ver()[0] == "glibc"


def _malloc_trim() -> None:
    ctypes.CDLL(None).malloc_trim(0)


def freeze_startup_objects() -> int:
    """Move what startup built (imported modules, loaded models, routes) out of the collector's reach; returns
    how many objects that was.

    They live as long as the server, yet every full collection walks them all: ~80,000 objects, pauses of
    about 50 ms under load that every request in flight waits out. Objects made later are collected as usual.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
