"""The scheduler with a manual clock and scripted instances: deterministic, no sleeps."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from geserve._generated import model_config_pb2 as mc
from geserve.batching.policy import BatchingPolicy, QueuePolicy
from geserve.batching.request import ScheduledRequest
from geserve.batching.scheduler import Scheduler
from geserve.core.models import ModelScheduler
from geserve.core.stats import ModelStats
from geserve.errors import InternalError, UnavailableError
from geserve.repository.config import parse_config_text
from geserve.residency import SharedTensor, gather
from geserve.workers.batch import Batch
from geserve.workers.messages import BatchResult, InstanceSpec, TensorResult
from geserve.workers.pool import InstancePool

MS = 1_000_000


class ManualClock:
    """Time moves only when a test says so; due timers fire in order."""

    def __init__(self) -> None:
        self.now = 1_000 * MS
        self.timers: list[ManualTimer] = []

    def now_ns(self) -> int:
        return self.now

    def call_at(self, when_ns: int, callback: Callable[[], None]) -> ManualTimer:
        timer = ManualTimer(when_ns, callback)
        self.timers.append(timer)
        return timer

    def advance(self, ns: int) -> None:
        self.now += ns
        while True:
            due = sorted((t for t in self.timers if not t.cancelled and t.when <= self.now), key=lambda t: t.when)
            if not due:
                return
            due[0].cancelled = True
            due[0].callback()


class ManualTimer:
    def __init__(self, when: int, callback: Callable[[], None]) -> None:
        self.when, self.callback, self.cancelled = when, callback, False

    def cancel(self) -> None:
        self.cancelled = True


class ScriptedInstance:
    """An instance whose batches finish when the test says; outputs echo the inputs. Like a worker, it gathers each
    input's row blocks where they lie and answers each request's rows as tensors."""

    def __init__(self, clock: ManualClock, name: str = "i0") -> None:
        self.clock = clock
        self.spec = InstanceSpec("m", 1, name, "identity", b"", "", 0, False, 30)
        self.batches: list[dict[str, np.ndarray]] = []
        self.output_names: list[tuple[str, ...]] = []
        self._waiting: list[asyncio.Future[None]] = []
        self.alive = True
        self.fail_with: Exception | None = None
        self.answers_short = False  # a faulty instance: one result fewer than the batch has requests
        self.on_ready: Callable[[Any], None] | None = None
        self.capacity = 1
        self.incarnation = 0
        self.model_ready = True

    @property
    def recoverable(self) -> bool:
        return self.alive

    async def start(self) -> mc.ModelConfig:
        return mc.ModelConfig()

    async def stop(self, timeout_s: float) -> None:
        self.alive = False

    async def execute(self, batch: Batch) -> BatchResult:
        inputs = {
            name: gather([_tensor(part) for part in parts], _tensor(parts[0]).datatype)
            for name, parts in batch.inputs.items()
        }
        output_names = batch.output_names
        self.batches.append(dict(inputs))
        self.output_names.append(output_names)
        started = self.clock.now
        gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(gate)
        await gate
        if self.fail_with is not None:
            raise self.fail_with
        outputs = {name: inputs[name.replace("OUT", "IN")] for name in output_names}
        results: list[TensorResult] = []
        row = 0
        for request in batch.requests:
            own = {name: SharedTensor.local(outputs[name][row : row + request.rows]) for name in request.output_names}
            results.append(own)
            row += request.rows
        if self.answers_short:
            results.pop()
        return BatchResult(tuple(results), started + MS, self.clock.now - MS)

    @property
    def busy(self) -> int:
        return sum(1 for gate in self._waiting if not gate.done())

    def finish(self) -> None:
        """Complete the oldest running batch."""
        next(gate for gate in self._waiting if not gate.done()).set_result(None)


def _tensor(part: SharedTensor | np.ndarray) -> SharedTensor:
    """A row block as the scheduler hands it on (a test that builds its own requests may still give arrays)."""
    return part if isinstance(part, SharedTensor) else SharedTensor.local(part)


async def outputs_of(scheduler: ModelScheduler, request: ScheduledRequest) -> dict[str, np.ndarray]:
    """A request's outputs, read: the scheduler answers tensors."""
    outputs = (await scheduler.execute(request)).outputs
    assert all(isinstance(tensor, SharedTensor) for tensor in outputs.values())
    return {name: tensor.array for name, tensor in outputs.items()}


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def policy_from(text: str) -> BatchingPolicy:
    return BatchingPolicy.from_config(parse_config_text(text, "config.pbtxt"))


BATCHING = 'name: "m" max_batch_size: %d dynamic_batching { %s }'


class Harness:
    def __init__(self, policy: BatchingPolicy, instances: int = 1, capacity: int = 1) -> None:
        self.clock = ManualClock()
        self.instances = [ScriptedInstance(self.clock, f"i{n}") for n in range(instances)]
        for instance in self.instances:
            instance.capacity = capacity
        self.stats = ModelStats()
        self.pool = InstancePool(self.instances)
        self.scheduler = Scheduler("m", self.pool, policy, self.stats, self.clock)

    def submit(
        self, rows: int, value: float = 0.0, width: int = 2, **parameters: Any
    ) -> asyncio.Task[dict[str, np.ndarray]]:
        array = np.full((rows, width), value, dtype=np.float32)
        return asyncio.ensure_future(
            outputs_of(self.scheduler, ScheduledRequest({"IN0": SharedTensor.local(array)}, ("OUT0",), parameters))
        )

    def batch_rows(self) -> list[int]:
        return [len(batch["IN0"]) for instance in self.instances for batch in instance.batches]


async def test_without_dynamic_batching_each_request_runs_alone_in_order() -> None:
    h = Harness(BatchingPolicy(max_batch_size=8), instances=1)
    tasks = [h.submit(1, value=i) for i in range(3)]
    await settle()
    assert h.batch_rows() == [1] and h.stats.pending == 2
    for expected_pending in (1, 0):
        h.instances[0].finish()
        await settle()
        assert h.stats.pending == expected_pending
    h.instances[0].finish()
    results = await asyncio.gather(*tasks)
    assert [r["OUT0"][0, 0] for r in results] == [0, 1, 2]
    assert h.stats.execution_count == 3 and h.stats.inference_count == 3


async def test_no_delay_dispatches_at_once_and_queue_grows_while_busy() -> None:
    h = Harness(policy_from(BATCHING % (4, "")))
    first = h.submit(1, value=1)
    await settle()
    assert h.batch_rows() == [1]  # dynamic_batching {} means no delay
    later = [h.submit(1, value=v) for v in (2, 3, 4, 5, 6)]
    await settle()
    assert h.stats.pending == 5
    h.instances[0].finish()
    await settle()
    assert h.batch_rows() == [1, 4] and h.stats.pending == 1
    h.instances[0].finish()
    await settle()
    h.instances[0].finish()
    results = await asyncio.gather(first, *later)
    # Each request gets its own rows back.
    assert [r["OUT0"].tolist() for r in results] == [[[v, v]] for v in (1, 2, 3, 4, 5, 6)]
    assert h.batch_rows() == [1, 4, 1]
    assert h.stats.execution_count == 3 and h.stats.inference_count == 6
    assert sorted(h.stats.batch_stats) == [1, 4]


async def test_delay_waits_for_the_oldest_request() -> None:
    h = Harness(policy_from(BATCHING % (8, "max_queue_delay_microseconds: 100000")))
    tasks = [h.submit(2)]
    await settle()
    assert h.batch_rows() == []
    h.clock.advance(50 * MS)
    tasks.append(h.submit(3))
    await settle()
    assert h.batch_rows() == []
    h.clock.advance(49 * MS)
    await settle()
    assert h.batch_rows() == []
    h.clock.advance(1 * MS)  # 100 ms after the first request
    await settle()
    assert h.batch_rows() == [5]
    h.instances[0].finish()
    results = await asyncio.gather(*tasks)
    assert [r["OUT0"].shape for r in results] == [(2, 2), (3, 2)]
    assert h.stats.queue.count == 2
    assert h.stats.queue.ns == 100 * MS + 50 * MS


async def test_full_batch_goes_before_the_delay() -> None:
    h = Harness(policy_from(BATCHING % (4, "max_queue_delay_microseconds: 1000000")))
    tasks = [h.submit(1) for _ in range(3)]
    await settle()
    assert h.batch_rows() == []
    tasks.append(h.submit(1))
    await settle()
    assert h.batch_rows() == [4]
    h.instances[0].finish()
    await asyncio.gather(*tasks)


async def test_rows_never_exceed_max_batch_size() -> None:
    h = Harness(policy_from(BATCHING % (4, "max_queue_delay_microseconds: 1000000")))
    tasks = [h.submit(3), h.submit(3)]
    await settle()
    assert h.batch_rows() == [3]  # 3 + 3 > 4: the first batch is complete as it is
    h.instances[0].finish()
    await settle()
    assert h.batch_rows() == [3]  # the second waits for company or the delay
    h.clock.advance(1000 * MS)
    await settle()
    assert h.batch_rows() == [3, 3]
    h.instances[0].finish()
    await asyncio.gather(*tasks)


async def test_preferred_sizes() -> None:
    h = Harness(policy_from(BATCHING % (8, "preferred_batch_size: [2, 4] max_queue_delay_microseconds: 1000000")))
    blocker = h.submit(1, width=3)
    await settle()
    assert h.batch_rows() == []  # one row is no preferred size: it waits
    tasks = [h.submit(1, value=v) for v in range(5)]
    await settle()
    assert h.batch_rows() == [1]  # a request of another shape cut its batch: it went at once
    h.instances[0].finish()
    await settle()
    # Five rows queued: the largest preferred size that can be formed (4) goes at once.
    assert h.batch_rows() == [1, 4]
    h.instances[0].finish()
    await settle()
    assert h.batch_rows() == [1, 4]  # one row is not preferred: it waits for the delay
    h.clock.advance(1000 * MS)
    await settle()
    assert h.batch_rows() == [1, 4, 1]
    h.instances[0].finish()
    results = await asyncio.gather(blocker, *tasks)
    assert [r["OUT0"][0, 0] for r in results[1:]] == [0, 1, 2, 3, 4]


async def test_requests_with_other_shapes_never_share_a_batch() -> None:
    h = Harness(policy_from(BATCHING % (8, "max_queue_delay_microseconds: 1000000")))
    tasks = [h.submit(1, width=2), h.submit(1, width=2), h.submit(1, width=3), h.submit(1, width=2)]
    await settle()
    # Order is kept: the width-3 request ends the first batch (which then goes at once)
    # rather than being skipped over.
    assert h.batch_rows() == [2]
    h.instances[0].finish()
    await settle()
    assert h.instances[0].batches[1]["IN0"].shape == (1, 3)
    h.instances[0].finish()
    await settle()
    assert len(h.instances[0].batches) == 2  # the last one waits for company or the delay
    h.clock.advance(1000 * MS)
    await settle()
    h.instances[0].finish()
    await asyncio.gather(*tasks)
    assert [b["IN0"].shape for b in h.instances[0].batches] == [(2, 2), (1, 3), (1, 2)]


async def test_batches_spread_over_instances() -> None:
    h = Harness(policy_from(BATCHING % (2, "")), instances=2)
    tasks = [h.submit(1, value=v) for v in range(6)]
    await settle()
    assert [len(i.batches) for i in h.instances] == [1, 1]
    assert h.stats.pending == 4
    h.instances[1].finish()
    await settle()
    assert [len(i.batches) for i in h.instances] == [1, 2]
    assert len(h.instances[1].batches[1]["IN0"]) == 2
    for _ in range(3):
        for instance in h.instances:
            if instance.busy:
                instance.finish()
        await settle()
    results = await asyncio.gather(*tasks)
    assert sorted(r["OUT0"][0, 0] for r in results) == list(range(6))


async def test_a_batch_waits_behind_a_running_one_only_when_full() -> None:
    """A pipelined instance takes a second batch while one runs, but only a full one: a partial batch
    keeps growing until the instance is free, since the device could not start it earlier anyway."""
    h = Harness(policy_from(BATCHING % (4, "max_queue_delay_microseconds: 1000")), capacity=2)
    tasks = [h.submit(1, value=v) for v in range(4)]
    await settle()
    assert h.batch_rows() == [4]
    tasks += [h.submit(1, value=v) for v in range(4, 6)]
    h.clock.advance(5 * MS)  # long past the delay: still not sent behind the running batch
    await settle()
    assert h.batch_rows() == [4]
    tasks += [h.submit(1, value=v) for v in range(6, 8)]
    await settle()
    assert h.batch_rows() == [4, 4]  # full: staged behind the running one
    assert h.instances[0].busy == 2
    tasks.append(h.submit(1, value=8))
    await settle()
    h.instances[0].finish()
    await settle()
    assert h.batch_rows() == [4, 4]  # one slot is free again, but only behind a running batch
    h.instances[0].finish()
    await settle()
    assert h.batch_rows() == [4, 4]  # a free instance: the delay rules again
    h.clock.advance(1 * MS)
    await settle()
    assert h.batch_rows() == [4, 4, 1]
    h.instances[0].finish()
    results = await asyncio.gather(*tasks)
    assert [r["OUT0"][0, 0] for r in results] == list(range(9))


async def test_a_free_instance_gets_the_batch_before_a_slot_behind_a_busy_one() -> None:
    h = Harness(policy_from(BATCHING % (2, "")), instances=2, capacity=2)
    tasks = [h.submit(2, value=0), h.submit(1, value=1)]
    await settle()
    assert [len(i.batches) for i in h.instances] == [1, 1]
    for instance in h.instances:
        instance.finish()
    await asyncio.gather(*tasks)


async def test_priorities() -> None:
    h = Harness(policy_from(BATCHING % (1, "priority_levels: 3 default_priority_level: 2")))
    busy = h.submit(1, value=-1)
    await settle()
    low = h.submit(1, value=3, priority=3)
    default = h.submit(1, value=2)
    high = h.submit(1, value=1, priority=1)
    out_of_range = h.submit(1, value=2.5, priority=9)  # treated as the default level
    await settle()
    for _ in range(5):
        h.instances[0].finish()
        await settle()
    await asyncio.gather(busy, low, default, high, out_of_range)
    assert [b["IN0"][0, 0] for b in h.instances[0].batches] == [-1, 1, 2, 2.5, 3]


async def test_max_queue_size_counts_only_queued_requests() -> None:
    h = Harness(policy_from(BATCHING % (1, "default_queue_policy { max_queue_size: 2 }")))
    running = h.submit(1)
    await settle()
    queued = [h.submit(1), h.submit(1)]
    await settle()
    with pytest.raises(UnavailableError, match=r"^Exceeds maximum queue size$"):
        await h.submit(1)
    assert h.stats.failures["REJECTED"] == 1
    for _ in range(3):
        h.instances[0].finish()
        await settle()
    await asyncio.gather(running, *queued)


async def test_timeout_reject() -> None:
    h = Harness(policy_from(BATCHING % (1, "default_queue_policy { default_timeout_microseconds: 5000 }")))
    running = h.submit(1)
    await settle()
    waiting = h.submit(1)
    await settle()
    h.clock.advance(5 * MS)
    await settle()
    with pytest.raises(UnavailableError, match=r"^Request timeout expired$"):
        await waiting
    assert h.stats.failures["REJECTED"] == 1 and h.stats.pending == 0
    h.instances[0].finish()
    await running


async def test_timeout_delay_moves_request_behind_others() -> None:
    h = Harness(
        policy_from(BATCHING % (1, "default_queue_policy { timeout_action: DELAY default_timeout_microseconds: 5000 }"))
    )
    running = h.submit(1, value=0)
    await settle()
    delayed = h.submit(1, value=1)
    await settle()
    h.clock.advance(6 * MS)
    fresh = h.submit(1, value=2)
    await settle()
    for _ in range(3):
        h.instances[0].finish()
        await settle()
    await asyncio.gather(running, delayed, fresh)
    assert [b["IN0"][0, 0] for b in h.instances[0].batches] == [0, 2, 1]


@pytest.mark.parametrize(
    ("policy", "requested", "expected_ms"),
    [
        ("default_timeout_microseconds: 10000", 2000, 10),  # no override allowed
        ("default_timeout_microseconds: 10000 allow_timeout_override: true", 2000, 2),
        ("default_timeout_microseconds: 10000 allow_timeout_override: true", 50000, 10),  # may only lower
        ("allow_timeout_override: true", 3000, 3),
    ],
)
async def test_request_timeout_override(policy: str, requested: int, expected_ms: int) -> None:
    h = Harness(policy_from(BATCHING % (1, f"default_queue_policy {{ {policy} }}")))
    running = h.submit(1)
    await settle()
    waiting = h.submit(1, timeout=requested)
    await settle()
    h.clock.advance(expected_ms * MS - 1)
    await settle()
    assert not waiting.done()
    h.clock.advance(1)
    await settle()
    assert waiting.done()
    with pytest.raises(UnavailableError, match="Request timeout expired"):
        await waiting
    h.instances[0].finish()
    await running


async def test_per_priority_queue_policy() -> None:
    config = BATCHING % (
        1,
        "priority_levels: 2 default_queue_policy { max_queue_size: 1 } "
        "priority_queue_policy { key: 1 value: { max_queue_size: 3 } }",
    )
    h = Harness(policy_from(config))
    running = h.submit(1)
    await settle()
    high = [h.submit(1, priority=1) for _ in range(3)]
    low = h.submit(1, priority=2)
    await settle()
    with pytest.raises(UnavailableError, match="Exceeds maximum queue size"):
        await h.submit(1, priority=2)
    for _ in range(5):
        if h.instances[0].busy:
            h.instances[0].finish()
        await settle()
    await asyncio.gather(running, *high, low)


async def test_preserve_ordering() -> None:
    h = Harness(policy_from(BATCHING % (1, "preserve_ordering: true")), instances=2)
    first, second = h.submit(1, value=1), h.submit(1, value=2)
    await settle()
    h.instances[1].finish()  # the second request's batch finishes first
    await settle()
    assert not second.done()  # held until the first is answered
    h.instances[0].finish()
    await settle()
    assert first.done() and second.done()


async def test_without_preserve_ordering_answers_come_as_they_finish() -> None:
    h = Harness(policy_from(BATCHING % (1, "")), instances=2)
    first, second = h.submit(1, value=1), h.submit(1, value=2)
    await settle()
    h.instances[1].finish()
    await settle()
    assert second.done() and not first.done()
    h.instances[0].finish()
    await first


async def test_cancelled_request_leaves_the_queue() -> None:
    h = Harness(policy_from(BATCHING % (4, "max_queue_delay_microseconds: 1000000")))
    busy = h.submit(4)
    await settle()
    leaving, staying = h.submit(1, value=1), h.submit(1, value=2)
    await settle()
    assert h.stats.pending == 2
    leaving.cancel()
    await settle()
    assert h.stats.pending == 1 and h.stats.failures["CANCELED"] == 1
    h.instances[0].finish()
    h.clock.advance(1000 * MS)
    await settle()
    h.instances[0].finish()
    result = await staying
    assert result["OUT0"].tolist() == [[2, 2]]
    assert h.batch_rows() == [4, 1]
    await busy


async def test_backend_failure_fails_only_its_batch() -> None:
    h = Harness(policy_from(BATCHING % (2, "max_queue_delay_microseconds: 1000")))
    failing = [h.submit(1), h.submit(1)]
    await settle()
    later = h.submit(1)
    await settle()
    h.instances[0].fail_with = InternalError("boom")
    h.instances[0].finish()
    await settle()
    h.instances[0].fail_with = None
    for task in failing:
        with pytest.raises(InternalError, match="boom"):
            await task
    h.clock.advance(1 * MS)
    await settle()
    h.instances[0].finish()
    assert (await later)["OUT0"].shape == (1, 2)
    assert h.stats.failures["OTHER"] == 2 and h.stats.execution_count == 1


async def test_a_result_per_request_or_every_request_fails_and_the_next_batch_is_served() -> None:
    h = Harness(policy_from(BATCHING % (2, "max_queue_delay_microseconds: 1000")))
    h.instances[0].answers_short = True
    short = [h.submit(1, value=1.0), h.submit(1, value=2.0)]
    await settle()
    h.instances[0].finish()
    await settle()
    for task in short:
        with pytest.raises(InternalError, match="1 results for 2 requests"):
            await task
    h.instances[0].answers_short = False
    later = h.submit(1, value=3.0)
    await settle()
    h.clock.advance(1 * MS)
    await settle()
    h.instances[0].finish()
    assert (await later)["OUT0"][0, 0] == 3.0


async def test_stats_count_rows_and_executions() -> None:
    h = Harness(policy_from(BATCHING % (8, "max_queue_delay_microseconds: 10000")))
    tasks = [h.submit(rows) for rows in (1, 2, 3)]
    await settle()
    h.clock.advance(10 * MS)
    await settle()
    h.clock.advance(7 * MS)
    h.instances[0].finish()
    await asyncio.gather(*tasks)
    stats = h.stats
    assert (stats.inference_count, stats.execution_count) == (6, 1)
    assert stats.success.count == 3 and stats.queue.count == 3
    assert stats.compute_infer.ns == 3 * 5 * MS  # each request carries its batch's infer time
    assert stats.compute_input.ns == 3 * MS and stats.compute_output.ns == 3 * MS
    assert stats.batch_stats[6].compute_infer.count == 1
    assert stats.last_inference_ms > 0


async def test_dead_instances_fail_queued_requests() -> None:
    h = Harness(policy_from(BATCHING % (1, "")))
    running = h.submit(1)
    await settle()
    queued = h.submit(1)
    await settle()
    h.instances[0].alive = False
    h.instances[0].fail_with = InternalError("instance exited")
    h.instances[0].finish()
    with pytest.raises(InternalError):
        await running
    with pytest.raises(UnavailableError, match="no running instance"):
        await queued
    with pytest.raises(UnavailableError, match="no running instance"):
        await h.submit(1)


def test_policy_from_config_defaults() -> None:
    policy = policy_from('name: "m" max_batch_size: 4 dynamic_batching { priority_levels: 2 }')
    assert policy.dynamic and policy.max_batch_size == 4 and policy.max_delay_ns == 0
    assert policy.priority_levels == 2 and policy.default_priority == 1
    assert policy.level(0) == 1 and policy.level(2) == 2 and policy.level(3) == 1
    assert not policy_from('name: "m" max_batch_size: 4').dynamic
    assert not policy_from('name: "m" max_batch_size: 0 dynamic_batching {}').dynamic
    assert QueuePolicy(default_timeout_ns=0, allow_timeout_override=False).timeout_ns(100) == 0
