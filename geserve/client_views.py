"""A client region's bytes viewed in place: holes stay free zeros; a shrink while they are read, zeros and an error."""

# A worker reads a large input from the client's segment itself, as Triton's backends read a mapped region, instead
# of copying it into memory of its own. Two things a plain mapping of a client's file would get wrong are kept out:
# - a hole (a sparse region, which costs its client nothing) read through a mapping becomes a real page of the
#   client's segment; here only the file's data extents are mapped, and its holes are anonymous zero pages, which
#   cost nobody anything;
# - a client that shrinks its segment while the view is read turns the read into SIGBUS, which kills the reader;
#   here a SIGBUS handler puts zeros where the mapping was and marks the view torn, and the request that owns it
#   is answered with an error instead of with those zeros.

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
# Data extents mapped one by one per view (each is a kernel mapping, and vm.max_map_count is finite); a region
# written in more pieces than this has the rest read into the view instead: memory its client paid for too.
MAPPED_EXTENTS = 64

_SIGBUS = 7
_SA_SIGINFO = 4
_SA_NODEFER = 0x40000000
_MADV_POPULATE_READ = 22  # Linux 5.14: page tables filled in one call, without breaking copy-on-write
_MAP_FIXED = 0x10  # the same on every Linux architecture; Python's mmap module does not export it
_MAP_FAILED = ctypes.c_void_p(-1).value


class _SigInfo(ctypes.Structure):
    """The head of siginfo_t: the same on every 64-bit Linux glibc supports (si_addr after three ints and padding)."""

    _fields_ = [
        ("signo", ctypes.c_int),
        ("errno", ctypes.c_int),
        ("code", ctypes.c_int),
        ("pad", ctypes.c_int),
        ("addr", ctypes.c_void_p),
    ]


_HANDLER = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.POINTER(_SigInfo), ctypes.c_void_p)


class _SigAction(ctypes.Structure):
    """glibc's struct sigaction (x86_64 and aarch64 alike)."""

    _fields_ = [
        ("handler", ctypes.c_void_p),
        ("mask", ctypes.c_ulong * 16),
        ("flags", ctypes.c_int),
        ("restorer", ctypes.c_void_p),
    ]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.sigaction.argtypes = [ctypes.c_int, ctypes.POINTER(_SigAction), ctypes.POINTER(_SigAction)]


class _Span:
    """Addresses a view's memory covers, and whether the guard had to zero them."""

    __slots__ = ("base", "length", "torn")

    def __init__(self, base: int, length: int) -> None:
        self.base, self.length, self.torn = base, length, False

    def zero(self) -> bool:
        """Put anonymous zeros over the whole span (from the SIGBUS handler: one syscall)."""
        self.torn = True
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED
        return bool(_libc.mmap(self.base, self.length, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0) != _MAP_FAILED)


class View:
    """A client region's bytes [offset, offset + nbytes) mapped in this process: `array` views them (and keeps
    them, and their guard, alive); `torn` turns true if the segment shrank under the view while it was read, and
    the view then reads as zeros."""

    __slots__ = ("_span", "array")

    def __init__(self, descriptor: int, offset: int, nbytes: int) -> None:
        start = offset - offset % PAGE
        length = -(-(offset + nbytes - start) // PAGE) * PAGE
        # Anonymous zeros over the whole span first (free until written): the file's data extents are mapped over
        # them, and unmapping the reservation unmaps everything, whatever the guard put in place since.
        reservation = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        keeper = (ctypes.c_char * length).from_buffer(reservation)
        self._span = _Span(ctypes.addressof(keeper), length)
        # Unguarded before unmapped: the keeper's finalizer runs before it lets go of the reservation.
        _GUARD.watch(self._span)
        weakref.finalize(keeper, _GUARD.forget, self._span.base)
        whole = memoryview(keeper).cast("B")
        self._fill(descriptor, start, whole)
        self.array = np.frombuffer(whole, dtype=np.uint8)[offset - start : offset - start + nbytes]

    @property
    def torn(self) -> bool:
        return self._span.torn

    def _fill(self, descriptor: int, start: int, whole: memoryview) -> None:
        mapped = 0
        for first, end in _data_extents(descriptor, start, start + len(whole)):
            if mapped < MAPPED_EXTENTS:
                at, flags = self._span.base + first - start, mmap.MAP_PRIVATE | _MAP_FIXED
                protection = mmap.PROT_READ | mmap.PROT_WRITE
                if _libc.mmap(at, end - first, protection, flags, descriptor, first) != _MAP_FAILED:
                    # Faulting the pages in one call costs a fraction of faulting them one by one as they are read
                    # (older kernels refuse the advice: then they fault one by one). A shrink meanwhile: an error.
                    _libc.madvise(at, end - first, _MADV_POPULATE_READ)
                    mapped += 1
                    continue
            target, done = whole[first - start : end - start], 0
            while done < len(target):
                read = os.preadv(descriptor, [target[done:]], first + done)
                if read <= 0:  # shrunk while being read: what is left reads as zeros
                    self._span.torn = True
                    return
                done += read


def _data_extents(descriptor: int, start: int, end: int) -> list[tuple[int, int]]:
    """The page-aligned ranges of [start, end) the file holds data in (holes left out); past the file's end, none."""
    extents: list[tuple[int, int]] = []
    position = start
    while position < end:
        try:
            data = os.lseek(descriptor, position, os.SEEK_DATA)
        except OSError as error:
            if error.errno == errno.ENXIO:  # no data after position (or position is past the end)
                break
            raise
        if data >= end:
            break
        hole = min(os.lseek(descriptor, data, os.SEEK_HOLE), end)
        first, last = data - data % PAGE, min(-(-hole // PAGE) * PAGE, end)
        if extents and extents[-1][1] >= first:
            extents[-1] = (extents[-1][0], max(extents[-1][1], last))
        else:
            extents.append((first, last))
        position = hole
    return extents


class _Guard:
    """The spans of the views alive in this process, and the SIGBUS handler that zeroes the one a fault falls in. A
    fault anywhere else is handed back to whatever handled SIGBUS before (by default the process dies, as it would)."""

    def __init__(self) -> None:
        self._spans: dict[int, _Span] = {}
        self._lock = threading.Lock()
        self._previous = _SigAction()
        self._handler = _HANDLER(self._on_sigbus)

    def watch(self, span: _Span) -> None:
        with self._lock:
            self._install()
            self._spans[span.base] = span

    def forget(self, base: int) -> None:
        with self._lock:
            self._spans.pop(base, None)

    def _install(self) -> None:
        """Handle SIGBUS here, unless this handler already does (a handler set since, faulthandler's say, is
        chained to like the first one was)."""
        ours = ctypes.cast(self._handler, ctypes.c_void_p).value
        current = _SigAction()
        if _libc.sigaction(_SIGBUS, None, ctypes.byref(current)) != 0:
            raise OSError(ctypes.get_errno(), "sigaction(SIGBUS) failed")
        if current.handler == ours:
            return
        action = _SigAction()
        action.handler = ours
        action.flags = _SA_SIGINFO | _SA_NODEFER
        if _libc.sigaction(_SIGBUS, ctypes.byref(action), ctypes.byref(self._previous)) != 0:
            raise OSError(ctypes.get_errno(), "sigaction(SIGBUS) failed")

    def _on_sigbus(self, _signal: int, info: Any, _context: Any) -> None:
        # Runs in the faulting thread, which retries the read once this returns: it must not raise, nor take the
        # lock (copying the dict's values is atomic under the GIL, which ctypes takes to call it).
        try:
            address = info.contents.addr or 0
            for span in list(self._spans.values()):
                if span.base <= address < span.base + span.length and span.zero():
                    return
        except BaseException:  # a handler that raised would leave the fault to repeat forever
            pass
        _libc.sigaction(_SIGBUS, ctypes.byref(self._previous), None)


_GUARD = _Guard()


@dataclass(frozen=True, slots=True)
class Shortfall:
    """The segment holds fewer bytes than the view needs: `size`, not `needed`."""

    size: int
    needed: int


def view(descriptor: int, offset: int, nbytes: int) -> View | Shortfall:
    """A guarded view of the file's bytes [offset, offset + nbytes), or what it holds when that is too few."""
    size = os.fstat(descriptor).st_size
    if size < offset + nbytes:
        return Shortfall(size, offset + nbytes)
    return View(descriptor, offset, nbytes)
