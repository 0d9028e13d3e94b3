"""Work leaves the event loop only past its threshold."""

from __future__ import annotations

import threading

from geserve.offload import COMPRESSION_BYTES, COPY_BYTES, off_loop


def _where(tag: str, *, suffix: str = "") -> tuple[str, int]:
    return tag + suffix, threading.get_ident()


async def test_small_work_runs_here_and_large_work_on_a_thread() -> None:
    here = threading.get_ident()
    assert await off_loop(COPY_BYTES, COPY_BYTES, _where, "a", suffix="!") == ("a!", here)
    result, thread = await off_loop(COPY_BYTES + 1, COPY_BYTES, _where, "b")
    assert result == "b" and thread != here
    assert COMPRESSION_BYTES < COPY_BYTES  # compression costs more per byte than a copy
