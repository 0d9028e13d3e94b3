"""Ragged inputs in the dynamic batcher, passive instances in the pool, and the load errors for the
batching fields geserve does not serve."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from geserve._generated import model_config_pb2 as mc
from geserve.batching.policy import BatchingPolicy
from geserve.batching.request import ScheduledRequest
from geserve.batching.scheduler import Scheduler
from geserve.core.stats import ModelStats
from geserve.errors import ModelLoadError, UnavailableError
from geserve.repository.config import parse_config_text, validate_config
from geserve.residency import SharedTensor
from geserve.workers.batch import Batch
from geserve.workers.messages import BatchResult, InstanceSpec
from geserve.workers.pool import InstancePool

RAGGED = """
name: "m" backend: "python" max_batch_size: 8
dynamic_batching { }
input [
  { name: "IN0" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true },
  { name: "IN1" data_type: TYPE_FP32 dims: [ -1 ] }
]
output [ { name: "OUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""


class RecordingInstance:
    """Takes every batch it is given and answers each request with nothing; the first batch waits until
    `release`, so that the requests behind it queue up."""

    def __init__(self, name: str = "i0", passive: bool = False) -> None:
        self.spec = InstanceSpec("m", 1, name, "python", b"", "", 0, False, 30, passive=passive)
        self.batches: list[Batch] = []
        self.alive = True
        self.on_ready: Any = None
        self.capacity = 1
        self.incarnation = 0
        self.model_ready = True
        self.gate = asyncio.Event()

    @property
    def recoverable(self) -> bool:
        return self.alive

    async def execute(self, batch: Batch) -> BatchResult:
        self.batches.append(batch)
        if len(self.batches) == 1:
            await self.gate.wait()
        return BatchResult(tuple({} for _ in batch.requests), 0, 0)


def request(in0: np.ndarray, in1: np.ndarray) -> ScheduledRequest:
    return ScheduledRequest({"IN0": SharedTensor.local(in0), "IN1": SharedTensor.local(in1)}, ("OUT0",))


async def batches_formed(policy: BatchingPolicy, requests: list[ScheduledRequest]) -> list[Batch]:
    """The batches `requests` form when they all queue behind a running one."""
    instance = RecordingInstance()
    scheduler = Scheduler("m", InstancePool([instance]), policy, ModelStats())
    first = asyncio.ensure_future(scheduler.execute(request(np.zeros((1, 1), np.float32), np.zeros((1, 4)))))
    await asyncio.sleep(0)
    tasks = [asyncio.ensure_future(scheduler.execute(item)) for item in requests]
    await asyncio.sleep(0)
    instance.gate.set()
    await asyncio.gather(first, *tasks)
    return instance.batches[1:]


def policy_of(text: str) -> BatchingPolicy:
    return BatchingPolicy.from_config(parse_config_text(text, "config.pbtxt"))


async def test_requests_whose_ragged_input_differs_share_one_batch_with_their_own_shapes() -> None:
    policy = policy_of(RAGGED)
    assert policy.ragged_inputs == frozenset({"IN0"})
    lengths = (2, 5, 3)
    items = [request(np.arange(n, dtype=np.float32).reshape(1, n), np.zeros((1, 4), np.float32)) for n in lengths]
    batches = await batches_formed(policy, items)
    assert len(batches) == 1
    batch = batches[0]
    # The ragged input travels flattened, request after request; the other stays in rows.
    assert [part.shape for part in batch.inputs["IN0"]] == [(2,), (5,), (3,)]
    assert [part.array.tolist() for part in batch.inputs["IN0"]] == [list(map(float, range(n))) for n in lengths]
    assert [part.shape for part in batch.inputs["IN1"]] == [(1, 4)] * 3
    assert [info.ragged_shapes for info in batch.requests] == [(("IN0", (1, n)),) for n in lengths]


async def test_a_differing_non_ragged_input_still_ends_the_batch() -> None:
    items = [
        request(np.zeros((1, 2), np.float32), np.zeros((1, 4), np.float32)),
        request(np.zeros((1, 3), np.float32), np.zeros((1, 4), np.float32)),
        request(np.zeros((1, 3), np.float32), np.zeros((1, 6), np.float32)),
    ]
    batches = await batches_formed(policy_of(RAGGED), items)
    assert [len(batch.requests) for batch in batches] == [2, 1]


async def test_a_batch_whose_ragged_inputs_cannot_travel_fails_its_requests_and_the_next_is_served(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(*_: object) -> None:
        raise ValueError("cannot flatten")

    monkeypatch.setattr("geserve.batching.scheduler._flatten_ragged", broken)
    items = [request(np.zeros((1, n), np.float32), np.zeros((1, 4), np.float32)) for n in (2, 5)]
    instance = RecordingInstance()
    scheduler = Scheduler("m", InstancePool([instance]), policy_of(RAGGED), ModelStats())
    blocker = asyncio.ensure_future(scheduler.execute(request(np.zeros((1, 1), np.float32), np.zeros((1, 4)))))
    await asyncio.sleep(0)
    queued = asyncio.gather(*(scheduler.execute(item) for item in items), return_exceptions=True)
    await asyncio.sleep(0)  # queued behind the first batch, the two form one batch of their own
    instance.gate.set()
    outcomes = await asyncio.wait_for(queued, 10)
    await blocker
    assert [type(outcome).__name__ for outcome in outcomes] == ["InternalError"] * 2
    assert "cannot flatten" in str(outcomes[0])
    await asyncio.wait_for(scheduler.execute(items[0]), 10)  # alone: nothing to flatten


async def test_without_allow_ragged_batch_differing_dims_never_share_a_batch() -> None:
    items = [request(np.zeros((1, n), np.float32), np.zeros((1, 4), np.float32)) for n in (2, 5)]
    batches = await batches_formed(policy_of(RAGGED.replace("allow_ragged_batch: true", "")), items)
    assert [len(batch.requests) for batch in batches] == [1, 1]
    assert all(info.ragged_shapes == () for batch in batches for info in batch.requests)


async def test_passive_instances_never_get_a_batch() -> None:
    active, passive = RecordingInstance("active"), RecordingInstance("passive", passive=True)
    active.gate.set()
    pool = InstancePool([active], [passive])
    scheduler = Scheduler("m", pool, BatchingPolicy(max_batch_size=8), ModelStats())
    await asyncio.gather(*(scheduler.execute(request(np.zeros((1, 2)), np.zeros((1, 2)))) for _ in range(4)))
    assert len(active.batches) == 4 and passive.batches == []


async def test_a_version_whose_instances_are_all_passive_is_ready_but_refuses_requests() -> None:
    passive = RecordingInstance("passive", passive=True)
    pool = InstancePool([], [passive])
    assert pool.ready() and pool.passive_only
    assert not pool.recoverable() and not pool.has_idle()
    scheduler = Scheduler("m", pool, BatchingPolicy(max_batch_size=8), ModelStats())
    with pytest.raises(UnavailableError, match="model 'm' has no instance that takes requests: every instance group"):
        await scheduler.execute(request(np.zeros((1, 2)), np.zeros((1, 2))))
    assert passive.batches == []


def config_of(text: str) -> mc.ModelConfig:
    return parse_config_text(text, "config.pbtxt")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            RAGGED.replace('"python"', '"onnxruntime"'),
            "model 'm': input 'IN0' sets allow_ragged_batch, which geserve's 'onnxruntime' backend does not support",
        ),
        (
            RAGGED.replace("dynamic_batching { }", "sequence_batching {}"),
            "model 'm': input 'IN0' sets allow_ragged_batch, which geserve supports with the dynamic batcher only",
        ),
        (
            RAGGED + 'batch_input [ { kind: BATCH_ACCUMULATED_ELEMENT_COUNT target_name: "INDEX" '
            'data_type: TYPE_FP32 source_input: "IN0" } ]',
            "model 'm': batch_input of kind BATCH_ACCUMULATED_ELEMENT_COUNT (target 'INDEX') is not supported by "
            "geserve's 'python' backend: as under Triton's python backend",
        ),
        (
            RAGGED.replace('"python"', '"ge"')
            + 'batch_output [ { target_name: "OUT0" kind: BATCH_SCATTER_WITH_INPUT_SHAPE source_input: "IN0" } ]',
            "model 'm': batch_output of kind BATCH_SCATTER_WITH_INPUT_SHAPE (target 'OUT0') is not supported by "
            "geserve's 'ge' backend",
        ),
        (
            RAGGED.replace("allow_ragged_batch: true", "")
            + 'instance_group [ { name: "g" kind: KIND_MODEL gpus: [ 0 ] } ]',
            "instance group g of model m has kind KIND_MODEL but specifies one or more GPUs",
        ),
    ],
)
def test_batching_fields_geserve_cannot_serve_fail_the_load_naming_the_field(text: str, expected: str) -> None:
    with pytest.raises(ModelLoadError) as raised:
        validate_config(config_of(text))
    assert expected in raised.value.message


def test_ragged_inputs_on_a_python_model_with_the_dynamic_batcher_load() -> None:
    validate_config(config_of(RAGGED))
