"""ResponseOrder: an answer waits for every earlier request's, an abandoned request does not hold the others."""

from __future__ import annotations

import asyncio

from geserve.batching.ordering import ResponseOrder


def test_answers_leave_in_dispatch_order_whatever_order_they_come_in() -> None:
    order = ResponseOrder()
    turns = [order.issue() for _ in range(3)]
    sent: list[int] = []

    def answer(place: int) -> None:
        sent.append(place)
        turns[place].finish()

    turns[2].when_due(lambda: answer(2))
    turns[1].when_due(lambda: answer(1))
    assert sent == []
    turns[0].when_due(lambda: answer(0))
    assert sent == [0, 1, 2]


def test_an_abandoned_request_lets_the_next_one_go_once_its_own_turn_comes() -> None:
    order = ResponseOrder()
    first, middle, last = order.issue(), order.issue(), order.issue()
    sent: list[str] = []
    middle.finish()  # its client went away
    middle.finish()  # finishing twice changes nothing
    last.when_due(lambda: sent.append("last"))
    assert sent == []
    first.finish()
    assert sent == ["last"]


async def test_a_stream_reader_waits_for_the_earlier_requests() -> None:
    order = ResponseOrder()
    first, second = order.issue(), order.issue()
    reader = asyncio.ensure_future(second.wait())
    await asyncio.sleep(0)
    assert not reader.done()
    await first.wait()  # the head never waits
    first.finish()
    await reader
