"""The ensemble's one graph executor with scripted step models: side-by-side steps, summed timings, streams."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest

from geserve.batching.request import RequestTimestamps, ScheduledRequest, ScheduledResponse
from geserve.core.ensemble import EnsembleScheduler
from geserve.core.models import Model, ModelVersion, StreamedOutputs
from geserve.core.stats import ModelStats
from geserve.errors import InternalError, InvalidArgumentError
from geserve.repository.config import parse_config_text
from geserve.residency import SharedTensor
from geserve.types import InstanceStatus

MS = 1_000_000
STEP_MODEL = 'name: "%s" max_batch_size: 0 %s input [ { name: "IN" data_type: TYPE_FP32 dims: [ %d ] } ] ' + (
    'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 2 ] } ]'
)


class ScriptedStep:
    """A composing model's scheduler: adds its `increment`, optionally after a wait, with fixed timestamps; a
    decoupled one answers `responses` times."""

    def __init__(self, increment: float, gate: asyncio.Event | None = None, responses: int = 0) -> None:
        self.increment, self.gate, self.responses = increment, gate, responses
        self.requests: list[ScheduledRequest] = []
        self.answers: list[dict[str, SharedTensor]] = []
        self.started = asyncio.Event()

    async def execute(self, request: ScheduledRequest) -> ScheduledResponse:
        self.requests.append(request)
        self.started.set()
        if self.gate is not None:
            await self.gate.wait()
        timestamps = RequestTimestamps(0, 1 * MS, 3 * MS, 6 * MS, 10 * MS)  # 1, 2, 3 and 4 ms
        outputs = {"OUT": SharedTensor.local(request.inputs["IN"].array + self.increment)}
        self.answers.append(outputs)
        return ScheduledResponse(outputs, timestamps)

    async def stream(self, request: ScheduledRequest) -> AsyncIterator[StreamedOutputs]:
        self.requests.append(request)
        for index in range(self.responses):
            yield {"OUT": SharedTensor.local(request.inputs["IN"].array + self.increment * (index + 1))}, None, False
        yield None, None, True


class Ready:
    def ready(self) -> bool:
        return True

    async def read_statuses(self) -> list[InstanceStatus]:
        return []

    async def stop(self, timeout_s: float) -> None:
        return None

    def kill(self) -> None:
        return None


def composing(models: dict[str, Model], name: str, step: ScriptedStep, decoupled: bool = False, dims: int = 2) -> None:
    policy = "model_transaction_policy { decoupled: true }" if decoupled else ""
    config = parse_config_text(STEP_MODEL % (name, policy, dims), "config.pbtxt")
    models[name] = Model(name, {1: ModelVersion(config, 1, step, Ready(), ModelStats())})


def ensemble(steps: str, outputs: str, decoupled: bool = False) -> tuple[EnsembleScheduler, ModelStats]:
    """An ensemble over inputs A (and the tensors its steps write) whose declared outputs are `outputs`."""
    policy = "model_transaction_policy { decoupled: true }" if decoupled else ""
    declared = ", ".join(f'{{ name: "{name}" data_type: TYPE_FP32 dims: [ 2 ] }}' for name in outputs.split())
    config = parse_config_text(
        f'name: "e" platform: "ensemble" max_batch_size: 0 {policy} '
        f'input [ {{ name: "A" data_type: TYPE_FP32 dims: [ 2 ] }} ] output [ {declared} ] '
        f"ensemble_scheduling {{ step [ {steps} ] }}",
        "config.pbtxt",
    )
    stats = ModelStats()
    return EnsembleScheduler(config, MODELS, stats), stats


def step(model: str, source: str, target: str) -> str:
    return (
        f'{{ model_name: "{model}" model_version: -1 input_map {{ key: "IN" value: "{source}" }} '
        f'output_map {{ key: "OUT" value: "{target}" }} }}'
    )


MODELS: dict[str, Model] = {}


@pytest.fixture(autouse=True)
def _fresh_models() -> None:
    MODELS.clear()


def request(output_names: tuple[str, ...], **parameters: int | bool) -> ScheduledRequest:
    return ScheduledRequest({"A": SharedTensor.local(np.zeros(2, np.float32))}, output_names, parameters, "r1")


async def test_steps_start_as_their_inputs_come_and_timings_are_summed() -> None:
    gate = asyncio.Event()
    slow, first, second = ScriptedStep(100.0, gate), ScriptedStep(1.0), ScriptedStep(10.0)
    for name, scripted in (("slow", slow), ("first", first), ("second", second)):
        composing(MODELS, name, scripted)
    scheduler, stats = ensemble(
        ", ".join((step("slow", "A", "S"), step("first", "A", "F"), step("second", "F", "G"))), "S G"
    )
    answer = asyncio.ensure_future(scheduler.execute(request(("G", "S"), priority=2, sequence_id=0)))
    for _ in range(20):
        await asyncio.sleep(0)
    # "second" waited only for "first", not for the slow step that started beside it.
    assert slow.started.is_set() and second.started.is_set() and not answer.done()
    gate.set()
    response = await answer
    assert response.outputs["G"].array.tolist() == [11.0, 11.0]
    assert response.outputs["S"].array.tolist() == [100.0, 100.0]
    assert response.timestamps is None  # an ensemble's timestamps are its steps'
    assert stats.success.count == 1 and stats.queue.ns == 3 * MS and stats.compute_infer.ns == 3 * 3 * MS
    assert stats.compute_input.ns == 3 * 2 * MS and stats.compute_output.ns == 3 * 4 * MS
    # Steps get the forwarded parameters, the request id, and hand their outputs on where they lie: the next step
    # is given the very tensor the step before answered, neither read nor copied.
    assert all(r.parameters == {"priority": 2, "sequence_id": 0} for r in second.requests)
    assert second.requests[0].request_id == "r1"
    assert second.requests[0].inputs["IN"] is first.answers[0]["OUT"]


async def test_a_failing_step_fails_the_request_and_cancels_the_others() -> None:
    gate = asyncio.Event()
    slow = ScriptedStep(1.0, gate)
    composing(MODELS, "slow", slow)
    composing(MODELS, "ok", ScriptedStep(1.0))
    composing(MODELS, "wide", ScriptedStep(1.0), dims=3)
    scheduler, stats = ensemble(", ".join((step("ok", "A", "S"), step("ok", "NEVER_WRITTEN", "B"))), "S")
    with pytest.raises(InternalError, match=r"did not produce output\(s\) \['B'\]"):
        await scheduler.execute(request(("S", "B")))
    assert stats.failures["OTHER"] == 1
    # A step's own error is the request's, word for word, and the step running beside it is cancelled.
    scheduler, _ = ensemble(", ".join((step("slow", "A", "S"), step("wide", "A", "B"))), "S B")
    with pytest.raises(InvalidArgumentError, match="unexpected shape for input 'IN' for model 'wide'"):
        await scheduler.execute(request(("S", "B")))
    await asyncio.wait_for(scheduler.instances.stop(5.0), 1.0)  # nothing left running


async def test_each_response_of_a_decoupled_step_runs_the_steps_after_it() -> None:
    fan_out, after = ScriptedStep(1.0, responses=3), ScriptedStep(10.0)
    composing(MODELS, "fan_out", fan_out, decoupled=True)
    composing(MODELS, "after", after)
    scheduler, stats = ensemble(", ".join((step("fan_out", "A", "F"), step("after", "F", "G"))), "G", True)
    items = [item async for item in scheduler.stream(request(("G",)))]
    values = [outputs["G"].array[0] for outputs, _, _ in items[:-1] if outputs is not None]
    assert values == [11.0, 12.0, 13.0] and items[-1] == (None, None, True)
    assert len(after.requests) == 3 and stats.success.count == 1


async def test_the_ensemble_is_ready_while_its_steps_are_and_stop_waits_for_its_requests() -> None:
    gate = asyncio.Event()
    composing(MODELS, "slow", ScriptedStep(1.0, gate))
    scheduler, _ = ensemble(step("slow", "A", "S"), "S")
    steps = scheduler.instances
    assert steps.ready() and await steps.read_statuses() == []
    answer = asyncio.ensure_future(scheduler.execute(request(("S",))))
    await asyncio.sleep(0)
    stopping = asyncio.ensure_future(steps.stop(5.0))
    await asyncio.sleep(0)
    assert not steps.ready() and not stopping.done()
    gate.set()
    await stopping
    assert (await answer).outputs["S"].array.tolist() == [1.0, 1.0]
    del MODELS["slow"]
    fresh, _ = ensemble(step("slow", "A", "S"), "S")
    assert not fresh.instances.ready()  # a step's model is gone
