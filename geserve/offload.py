"""Work that grows with a payload leaves the event loop past a size named for its reason."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

# zlib (de)compresses at roughly 100-300 MB/s: 64 KiB keeps the loop busy ~0.2-0.6 ms, past a thread hop's cost.
COMPRESSION_BYTES = 64 << 10
# A memcpy runs at several GB/s: 1 MiB is ~0.1-0.3 ms, about what the hop to a thread and back costs.
COPY_BYTES = 1 << 20
# Splitting BYTES tensors makes one Python object per element, ~0.1 us each: 256 KiB of tiny elements is ~5-10 ms.
DECODE_BYTES = 256 << 10


async def off_loop(size: int, threshold: int, work: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """`work(*args, **kwargs)` on a thread when `size` (bytes) exceeds `threshold`, else here: for small payloads
    the hop to a thread costs more than the work, for large ones the loop would stall every other request."""
    if size > threshold:
        return await asyncio.to_thread(work, *args, **kwargs)
    return work(*args, **kwargs)
