"""The front-end's memory: request buffers reused without page faults, user settings kept, startup frozen."""

from __future__ import annotations

import gc
import platform
import subprocess
import sys

import pytest

from geserve.memory import bound_arenas, freeze_startup_objects, keep_freed_memory

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

# Rounds of 64 image-sized buffers in flight at once, each page written, all freed: the page faults of the
# rounds after the first, in a fresh interpreter so no earlier allocation has moved glibc's thresholds.
CHURN = """
import resource, sys
from geserve.memory import keep_freed_memory
if sys.argv[1] == "tuned":
    assert keep_freed_memory({})
size = 3 * 224 * 224 * 4
def round_():
    buffers = [bytearray(size) for _ in range(64)]
    for buffer in buffers:
        buffer[::4096] = b"\\1" * len(range(0, size, 4096))
round_()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    round_()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", CHURN, mode], capture_output=True, text=True, check=True)
    return int(done.stdout)


@glibc_only
def test_buffers_of_requests_in_flight_are_reused_instead_of_faulted_in_again() -> None:
    pages_per_round = 64 * (3 * 224 * 224 * 4 // 4096)
    untuned, tuned = _faults("default"), _faults("tuned")
    assert untuned > 2 * pages_per_round  # glibc's dynamic thresholds hand the heap top back every round
    assert tuned < pages_per_round // 10


# Three threads each fill and free 48 MiB of 1 MiB buffers, then malloc_trim: what the process still holds.
THREADS_CHURN = """
import ctypes, sys, threading
from pathlib import Path
from geserve.memory import bound_arenas, keep_freed_memory
assert keep_freed_memory({})
if sys.argv[1] == "bounded":
    assert bound_arenas({})
def rss_mib():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
def churn():
    buffers = [bytearray(1 << 20) for _ in range(48)]
    del buffers
before = rss_mib()
threads = [threading.Thread(target=churn) for _ in range(3)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
ctypes.CDLL(None).malloc_trim(0)
print(rss_mib() - before)
"""


def _kept_mib(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", THREADS_CHURN, mode], capture_output=True, text=True, check=True)
    return int(done.stdout)


@glibc_only
def test_memory_freed_on_other_threads_is_handed_back_by_a_trim() -> None:
    # Each thread's own arena would keep its heap whole under the raised trim threshold: 144 MiB here.
    assert _kept_mib("unbounded") > 96
    assert _kept_mib("bounded") < 16


def test_an_arena_cap_of_the_environment_stands() -> None:
    assert bound_arenas({"MALLOC_ARENA_MAX": "4"}) is False
    assert bound_arenas({"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}) is False


@pytest.mark.parametrize(
    "environ",
    [
        {"MALLOC_TRIM_THRESHOLD_": "131072"},
        {"MALLOC_MMAP_THRESHOLD_": "1"},
        {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"},
    ],
)
def test_malloc_settings_of_the_environment_stand(environ: dict[str, str]) -> None:
    assert keep_freed_memory(environ) is False


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_startup_objects_leave_the_generations_and_later_cycles_are_still_collected() -> None:
    try:
        startup = _Cycle()
        frozen = freeze_startup_objects()
        assert frozen == gc.get_freeze_count() > 0
        assert not any(obj is startup for generation in range(3) for obj in gc.get_objects(generation))
        later = _Cycle()
        assert any(obj is later for obj in gc.get_objects(0))
        del later
        assert gc.collect() >= 1
    finally:
        gc.unfreeze()
