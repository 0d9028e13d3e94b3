"""LingeringIds: ids ride on the owner's next message, or leave together after the linger; any thread may add."""

from __future__ import annotations

import asyncio
import threading

from geserve.lingering import LingeringIds


def test_ids_not_taken_leave_together_after_the_linger() -> None:
    async def main() -> list[tuple[int, ...]]:
        flushed: list[tuple[int, ...]] = []
        ids = LingeringIds(flushed.append, linger_s=0.05)
        ids.start()
        ids.add(1)
        ids.add(2)
        await asyncio.sleep(0.01)
        assert flushed == []  # still waiting for a message to ride on
        await asyncio.sleep(0.1)
        ids.add(3)  # a new linger for the next ones
        await asyncio.sleep(0.1)
        return flushed

    assert asyncio.run(main()) == [(1, 2), (3,)]


def test_a_message_leaving_takes_them_and_nothing_is_sent_twice() -> None:
    async def main() -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
        flushed: list[tuple[int, ...]] = []
        ids = LingeringIds(flushed.append, linger_s=0.02)
        ids.start()
        ids.add(1)
        ids.add(2)
        taken = ids.take()
        await asyncio.sleep(0.06)
        return taken, flushed

    assert asyncio.run(main()) == ((1, 2), [])


def test_ids_added_on_other_threads_are_all_handed_on() -> None:
    async def main() -> list[int]:
        flushed: list[tuple[int, ...]] = []
        ids = LingeringIds(flushed.append, linger_s=0.005)
        ids.start()

        def add(first: int) -> None:
            for item in range(first, first + 500):
                ids.add(item)

        threads = [threading.Thread(target=add, args=(first,)) for first in (0, 500, 1000)]
        for thread in threads:
            thread.start()
        taken: list[int] = []
        while any(thread.is_alive() for thread in threads):
            taken += ids.take()  # messages leaving meanwhile take some along
            await asyncio.sleep(0.001)
        for thread in threads:
            thread.join()
        await asyncio.sleep(0.05)
        return sorted(taken + [item for items in flushed for item in items])

    assert asyncio.run(main()) == list(range(1500))
