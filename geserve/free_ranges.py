"""The free ranges of an arena: sorted by offset, each merged with the free ranges on either side."""

from __future__ import annotations

import bisect


def give_back(free: list[tuple[int, int]], offset: int, length: int) -> None:
    """Return `length` bytes at `offset` to `free` (sorted (offset, length) pairs that never overlap), merged with
    a free neighbour on either side so that a later large request still finds one range."""
    index = bisect.bisect(free, (offset, length))
    if index < len(free) and free[index][0] == offset + length:
        length += free.pop(index)[1]
    if index > 0 and sum(free[index - 1]) == offset:
        offset, previous = free.pop(index - 1)
        length += previous
        index -= 1
    free.insert(index, (offset, length))


def take(free: list[tuple[int, int]], length: int) -> int | None:
    """The offset of `length` bytes taken from the first free range large enough (first fit), or None."""
    for index, (offset, size) in enumerate(free):
        if size >= length:
            if size == length:
                del free[index]
            else:
                free[index] = (offset + length, size - length)
            return offset
    return None
