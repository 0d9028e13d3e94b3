"""What a scheduler answers besides outputs (its batch's timestamps), and a version's lifecycle off the request path."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from geserve.batching.lifecycle import InstanceLifecycle
from geserve.batching.request import RequestTimestamps, ScheduledRequest
from geserve.residency import SharedTensor
from geserve.workers.batch import Batch
from tests.unit.test_batcher import BATCHING, MS, Harness, policy_from, settle


def request(value: float) -> ScheduledRequest:
    return ScheduledRequest({"IN0": SharedTensor.local(np.full((1, 2), value, np.float32))}, ("OUT0",))


async def test_execute_answers_the_timestamps_of_the_requests_batch() -> None:
    h = Harness(policy_from(BATCHING % (4, "max_queue_delay_microseconds: 2000")))
    queued_at = h.clock.now
    first = asyncio.ensure_future(h.scheduler.execute(request(1.0)))
    await settle()
    h.clock.advance(1 * MS)
    second = asyncio.ensure_future(h.scheduler.execute(request(2.0)))
    await settle()
    h.clock.advance(1 * MS)  # the delay is over: both go as one batch
    await settle()
    dispatched_at = h.clock.now
    h.clock.advance(5 * MS)
    h.instances[0].finish()  # the scripted model ran from 1 ms after the batch started to 1 ms before now
    answered = await first
    assert answered.outputs["OUT0"].array.tolist() == [[1.0, 1.0]]
    assert answered.timestamps == RequestTimestamps(
        queued_at, dispatched_at, dispatched_at + MS, dispatched_at + 4 * MS, dispatched_at + 5 * MS
    )
    assert answered.timestamps.durations() == (2 * MS, MS, 3 * MS, MS)
    later = await second
    assert later.timestamps is not None and later.timestamps.queue_start_ns == queued_at + MS
    assert [name for name, _ in answered.timestamps.marks()] == [
        "QUEUE_START",
        "COMPUTE_START",
        "COMPUTE_INPUT_END",
        "COMPUTE_OUTPUT_START",
        "COMPUTE_END",
    ]


def test_durations_never_go_negative_across_clocks() -> None:
    # The worker's clock may read a little behind the scheduler's: compute parts clamp at zero.
    assert RequestTimestamps(0, 10, 9, 8, 7).durations() == (10, 0, 0, 0)


async def test_stopping_lets_admitted_requests_finish_first() -> None:
    h = Harness(policy_from(BATCHING % (1, "")))
    lifecycle = InstanceLifecycle("m", h.pool, h.scheduler)
    assert lifecycle.ready()
    running, queued = h.submit(1, value=1.0), h.submit(1, value=2.0)
    await settle()
    stopping = asyncio.ensure_future(lifecycle.stop(30.0))
    await settle()
    assert not stopping.done() and h.instances[0].alive
    h.instances[0].finish()
    await settle()
    h.instances[0].finish()  # the queued request got its batch while stopping
    await stopping
    assert (await running)["OUT0"][0, 0] == 1.0 and (await queued)["OUT0"][0, 0] == 2.0
    assert not h.instances[0].alive and not lifecycle.ready()


async def test_stopping_gives_up_on_running_batches_after_the_timeout(caplog: pytest.LogCaptureFixture) -> None:
    h = Harness(policy_from(BATCHING % (1, "")))
    lifecycle = InstanceLifecycle("m", h.pool, h.scheduler)
    stuck = h.submit(1)
    await settle()
    await lifecycle.stop(0.01)
    assert "batches still running at shutdown" in caplog.text and not h.instances[0].alive
    stuck.cancel()


def test_a_batch_is_a_value() -> None:
    batch = Batch({"IN0": [SharedTensor.local(np.zeros(2))]}, ("OUT0",), ())
    assert batch.streams == {} and batch.cancellable == {} and batch.chain == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch.chain = (("m", 1, "i0"),)  # type: ignore[misc]
