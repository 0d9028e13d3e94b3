"""The sequence batcher with a manual clock and scripted instances: slots, padding, controls, backlog, idle, loss."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from geserve.batching.request import ScheduledRequest
from geserve.batching.sequence import SequenceScheduler
from geserve.core.stats import ModelStats
from geserve.errors import InvalidArgumentError, UnavailableError
from geserve.repository.config import parse_config_text
from geserve.repository.sequence import settings_of
from geserve.residency import SharedTensor
from geserve.workers.pool import InstancePool
from tests.unit.test_batcher import MS, ManualClock, ScriptedInstance, outputs_of, settle

CONTROLS = """
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END fp32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY bool_false_true: [ false, true ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
  ]
"""


class Harness:
    def __init__(
        self, max_batch_size: int, strategy: str = "", instances: int = 1, corrid: str = "UINT64", capacity: int = 1
    ) -> None:
        controls = CONTROLS.replace("TYPE_UINT64", f"TYPE_{corrid}")
        config = parse_config_text(
            f'name: "m" max_batch_size: {max_batch_size} '
            f"sequence_batching {{ max_sequence_idle_microseconds: 100000 {strategy} {controls} }}",
            "config.pbtxt",
        )
        self.clock = ManualClock()
        self.instances = [ScriptedInstance(self.clock, f"i{n}") for n in range(instances)]
        for instance in self.instances:
            instance.capacity = capacity
        self.stats = ModelStats()
        settings = settings_of(config)
        self.scheduler = SequenceScheduler("m", InstancePool(self.instances), settings, self.stats, self.clock)
        self.batched = max_batch_size > 0

    def send(
        self, sequence_id: int | str, value: float, start: bool = False, end: bool = False
    ) -> asyncio.Task[dict[str, np.ndarray]]:
        array = np.full((1, 2) if self.batched else (2,), value, dtype=np.float32)
        parameters: dict[str, Any] = {"sequence_id": sequence_id, "sequence_start": start, "sequence_end": end}
        return asyncio.ensure_future(
            outputs_of(self.scheduler, ScheduledRequest({"IN0": SharedTensor.local(array)}, ("OUT0",), parameters))
        )

    def column(self, batch: int, name: str, instance: int = 0) -> list[Any]:
        return np.asarray(self.instances[instance].batches[batch][name]).reshape(-1).tolist()


async def test_direct_pads_empty_slots_and_fills_the_controls() -> None:
    h = Harness(max_batch_size=4)
    a = h.send(11, 1.0, start=True)
    await settle()
    assert h.column(0, "READY") == [True] and h.column(0, "START") == [1] and h.column(0, "CORRID") == [11]
    b, c = h.send(12, 2.0, start=True), h.send(13, 3.0, start=True)
    await settle()
    h.instances[0].finish()
    assert (await a)["OUT0"].tolist() == [[1.0, 1.0]]
    await settle()
    # Slots 0 (A, nothing queued: padding), 1 (B) and 2 (C): one row per slot up to the highest one in use.
    assert h.column(1, "READY") == [False, True, True]
    assert h.column(1, "START") == [0, 1, 1] and h.column(1, "END") == [0.0, 0.0, 0.0]
    assert h.column(1, "CORRID") == [0, 12, 13]
    assert h.instances[0].batches[1]["IN0"].tolist() == [[0.0, 0.0], [2.0, 2.0], [3.0, 3.0]]
    h.instances[0].finish()
    assert (await b)["OUT0"].tolist() == [[2.0, 2.0]] and (await c)["OUT0"].tolist() == [[3.0, 3.0]]
    # Padding is not an inference.
    assert h.stats.inference_count == 3 and h.stats.execution_count == 2
    d = h.send(12, 4.0, end=True)
    await settle()
    assert h.column(2, "READY") == [False, True] and h.column(2, "END") == [0.0, 1.0]
    h.instances[0].finish()
    await d


async def test_a_sequence_runs_one_request_at_a_time_in_order() -> None:
    h = Harness(max_batch_size=4)
    tasks = [h.send(5, float(v), start=v == 0) for v in range(3)]
    await settle()
    for index in range(3):
        assert len(h.instances[0].batches) == index + 1, "a second request of the sequence ran alongside the first"
        assert h.instances[0].batches[index]["IN0"].tolist() == [[float(index)] * 2]
        h.instances[0].finish()
        await settle()
    assert [(await t)["OUT0"][0, 0] for t in tasks] == [0.0, 1.0, 2.0]


async def test_backlog_takes_freed_slots_in_arrival_order() -> None:
    h = Harness(max_batch_size=1)  # one slot
    a = h.send(1, 1.0, start=True)
    b, c = h.send(2, 2.0, start=True), h.send(3, 3.0, start=True)
    await settle()
    h.instances[0].finish()
    await a
    await settle()
    assert len(h.instances[0].batches) == 1 and h.stats.pending == 2  # 2 and 3 wait for the slot
    end = h.send(1, 4.0, end=True)
    await settle()
    h.instances[0].finish()
    await end
    await settle()
    assert h.column(2, "CORRID") == [2] and h.column(2, "START") == [1]  # the first to arrive takes the slot
    h.instances[0].finish()
    assert (await b)["OUT0"][0, 0] == 2.0
    await settle()
    assert not c.done()  # 2 holds the slot until it ends or idles out
    h.clock.advance(100 * MS)
    await settle()
    assert h.column(3, "CORRID") == [3]
    h.instances[0].finish()
    assert (await c)["OUT0"][0, 0] == 3.0


async def test_string_ids_are_refused_where_corrid_is_uint64() -> None:
    h = Harness(max_batch_size=2)
    with pytest.raises(InvalidArgumentError, match="data-type is 'BYTES', but model 'm' expects 'UINT64'"):
        await h.send("a", 1.0, start=True)


async def test_idle_sequences_free_their_slot_for_the_backlog() -> None:
    h = Harness(max_batch_size=1)
    a = h.send(1, 1.0, start=True)
    await settle()
    h.instances[0].finish()
    await a
    b = h.send(2, 2.0, start=True)
    await settle()
    assert len(h.instances[0].batches) == 1
    h.clock.advance(100 * MS)  # max_sequence_idle_microseconds: sequence 1 leaves its slot, 2 takes it
    await settle()
    assert h.column(1, "CORRID") == [2] and h.column(1, "START") == [1]
    h.instances[0].finish()
    await b
    with pytest.raises(InvalidArgumentError, match="must specify the START flag"):
        await h.send(1, 3.0)


async def test_oldest_batches_one_request_per_sequence() -> None:
    h = Harness(max_batch_size=4, strategy="oldest { max_candidate_sequences: 4 }")
    first = h.send(1, 1.0, start=True)
    await settle()
    later = [h.send(1, 2.0), h.send(2, 3.0, start=True), h.send(1, 4.0), h.send(3, 5.0, start=True)]
    await settle()
    h.instances[0].finish()
    await first
    await settle()
    # The oldest request of each ready sequence, compact (no padding), oldest first.
    assert h.column(1, "CORRID") == [1, 2, 3] and h.column(1, "READY") == [True] * 3
    assert h.instances[0].batches[1]["IN0"][:, 0].tolist() == [2.0, 3.0, 5.0]
    h.instances[0].finish()
    await settle()
    assert h.column(2, "CORRID") == [1]
    h.instances[0].finish()
    assert [(await t)["OUT0"][0, 0] for t in later] == [2.0, 3.0, 4.0, 5.0]


async def test_sequences_are_lost_with_their_instance() -> None:
    h = Harness(max_batch_size=2, instances=2)
    a, b = h.send(1, 1.0, start=True), h.send(2, 2.0, start=True)
    await settle()
    # Lowest slot first, across instances: one sequence on each.
    assert [len(i.batches) for i in h.instances] == [1, 1]
    for instance in h.instances:
        instance.finish()
    await asyncio.gather(a, b)
    h.instances[1].incarnation += 1  # died and came back: its state is gone
    with pytest.raises(UnavailableError, match="sequence 2 of model 'm' was lost"):
        await h.send(2, 3.0)
    with pytest.raises(InvalidArgumentError, match="must specify the START flag"):
        await h.send(2, 3.0)
    c = h.send(1, 4.0, end=True)
    await settle()
    h.instances[0].finish()
    assert (await c)["OUT0"][0, 0] == 4.0


async def test_batch_size_above_one_is_refused() -> None:
    h = Harness(max_batch_size=4)
    parameters: dict[str, Any] = {"sequence_id": 3, "sequence_start": True}
    array = np.zeros((2, 2), dtype=np.float32)
    with pytest.raises(InvalidArgumentError, match="must specify batch-size 1 due to requirements of sequence batcher"):
        await h.scheduler.execute(ScheduledRequest({"IN0": SharedTensor.local(array)}, ("OUT0",), parameters))


@pytest.mark.parametrize(
    ("corrid", "sequence_id", "message"),
    [
        ("UINT64", -5, "a numeric sequence id must be an unsigned 64-bit integer"),
        ("UINT64", 1 << 64, "a numeric sequence id must be an unsigned 64-bit integer"),
        ("INT32", 1 << 40, "does not fit the 'INT32' CORRID control of model 'm'"),
        ("STRING", 7, "sequence batching control 'CORRID' data-type is 'UINT64', but model 'm' expects 'BYTES'"),
    ],
)
async def test_ids_the_corrid_control_cannot_hold_are_refused(corrid: str, sequence_id: int, message: str) -> None:
    h = Harness(max_batch_size=2, corrid=corrid)
    with pytest.raises(InvalidArgumentError, match=message):
        await h.send(sequence_id, 1.0, start=True)
    good = h.send("s" if corrid == "STRING" else 3, 1.0, start=True)
    await settle()
    assert h.column(0, "CORRID") == ([b"s"] if corrid == "STRING" else [3])
    h.instances[0].finish()
    await good


@pytest.mark.parametrize("preserve", [True, False])
async def test_oldest_preserve_ordering_answers_in_dispatch_order(preserve: bool) -> None:
    strategy = f"oldest {{ max_candidate_sequences: 2 preserve_ordering: {str(preserve).lower()} }}"
    # Two batches on the instance at once, so the second can finish first.
    h = Harness(max_batch_size=1, strategy=strategy, capacity=2)
    first = h.send(1, 1.0, start=True, end=True)
    await settle()
    second = h.send(2, 2.0, start=True, end=True)
    await settle()
    assert len(h.instances[0].batches) == 2
    h.instances[0]._waiting[1].set_result(None)  # the later request's batch finishes first
    await settle()
    assert second.done() is not preserve
    h.instances[0].finish()
    assert (await first)["OUT0"].tolist() == [[1.0, 1.0]]
    assert (await second)["OUT0"].tolist() == [[2.0, 2.0]]


async def test_a_version_whose_instances_are_all_passive_says_so() -> None:
    h = Harness(max_batch_size=4)
    passive_only = SequenceScheduler(
        "m", InstancePool([], passive=h.instances), h.scheduler._settings, ModelStats(), h.clock
    )
    with pytest.raises(UnavailableError, match="has no instance that takes requests: every instance group is passive"):
        await outputs_of(
            passive_only,
            ScheduledRequest(
                {"IN0": SharedTensor.local(np.ones((1, 2), np.float32))},
                ("OUT0",),
                {"sequence_id": 1, "sequence_start": True},
            ),
        )
    assert h.instances[0].batches == []


async def test_time_in_the_backlog_is_not_idle_time() -> None:
    h = Harness(max_batch_size=1)  # one slot; max_sequence_idle_microseconds 100 ms
    a = h.send(1, 1.0, start=True)
    b = h.send(2, 2.0, start=True)  # waits in the backlog behind sequence 1
    await settle()
    h.instances[0].finish()
    await a
    for step in range(3):  # sequence 1 keeps its slot busy for 150 ms, while 2 waits longer than the idle limit
        h.clock.advance(50 * MS)
        middle = h.send(1, 10.0 + step, end=step == 2)
        await settle()
        h.instances[0].finish()
        assert (await middle)["OUT0"][0, 0] == 10.0 + step
    await settle()
    assert h.column(4, "CORRID") == [2] and h.column(4, "START") == [1]
    h.clock.advance(60 * MS)  # a long first request: idle time starts when it has run, not when it arrived
    h.instances[0].finish()
    assert (await b)["OUT0"][0, 0] == 2.0
    h.clock.advance(60 * MS)
    await settle()
    for batch, value, end in ((5, 3.0, False), (6, 4.0, True)):  # still its slot: the next requests are not refused
        nxt = h.send(2, value, end=end)
        await settle()
        if nxt.done():
            await nxt  # raises the refusal (today: 'must specify the START flag')
        assert h.column(batch, "CORRID") == [2] and h.column(batch, "START") == [0]
        h.instances[0].finish()
        assert (await nxt)["OUT0"][0, 0] == value
