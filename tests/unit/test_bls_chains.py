"""BLS call chains: how a batch's chains merge, and which requests could only wait for themselves."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from geserve.batching.policy import BatchingPolicy
from geserve.batching.request import ScheduledRequest
from geserve.core.calls import check_cycle
from geserve.errors import UnsupportedError
from geserve.types import CallChain, merge_chains
from tests.unit.test_batcher import Harness, outputs_of, settle

A, B = ("a", 1, "a_0"), ("b", 1, "b_0")


def test_a_merged_chain_holds_each_version_as_often_as_the_chain_that_holds_it_most() -> None:
    assert merge_chains([]) == ()
    assert merge_chains([(A,), (A,)]) == (A,)
    assert merge_chains([(A, B), (B, A, B)]) == (A, B, B)
    assert sorted(merge_chains([(A, A), (B,)])) == [A, A, B]
    assert merge_chains([(A,), (("a", 1, "a_1"),)]) == (A, ("a", 1, "a_1"))  # two instances of one version


def test_a_request_is_refused_once_its_chain_holds_every_instance() -> None:
    check_cycle("a", 1, 1, ())  # a client's request
    check_cycle("a", 1, 2, (A,))  # the other instance can run it
    check_cycle("a", 1, 2, (A, B, A))  # one instance, waiting twice: the other is free
    check_cycle("a", 2, 1, (A,))  # another version has instances of its own
    check_cycle("b", 1, 1, (A,))
    check_cycle("a", 1, None, (A, A))  # an ensemble: no instances of its own
    with pytest.raises(UnsupportedError, match=r"BLS call cycle: 'a' -> 'b' -> 'a'; every instance of model 'a'"):
        check_cycle("a", 1, 1, (A, B))
    with pytest.raises(UnsupportedError, match=r"version 1 \(2\) is waiting in this chain"):
        check_cycle("a", 1, 2, (A, B, ("a", 1, "a_1")))


def _submit(h: Harness, value: float, chain: CallChain = ()) -> asyncio.Task[dict[str, np.ndarray]]:
    request = ScheduledRequest({"IN0": np.full((1, 2), value, dtype=np.float32)}, ("OUT0",), chain=chain)
    return asyncio.ensure_future(outputs_of(h.scheduler, request))


async def test_when_every_instance_waits_for_a_self_call_queued_behind_it_the_newest_fails() -> None:
    h = Harness(BatchingPolicy(max_batch_size=8), instances=2)  # ScriptedInstances "i0" and "i1" of m version 1
    outer = [_submit(h, 1.0), _submit(h, 2.0)]
    await settle()
    first = _submit(h, 3.0, (("m", 1, "i0"),))  # i0's model calls m: i1 could still take it once free
    await settle()
    assert not first.done() and h.stats.pending == 1
    second = _submit(h, 4.0, (("x", 1, "x_0"), ("m", 1, "i1")))  # now i1 waits for m too: neither can run
    await settle()
    assert second.done(), "the calls wait for each other"
    with pytest.raises(UnsupportedError, match=r"'x' -> 'm' -> 'm'; every instance of model 'm' version 1 \(2\)"):
        await second
    assert not first.done()
    h.instances[1].finish()  # i1's model, told, finishes: the call queued by i0 runs there
    await settle()
    h.instances[1].finish()
    assert (await first)["OUT0"].tolist() == [[3.0, 3.0]]
    h.instances[0].finish()
    assert [(await task)["OUT0"][0, 0] for task in outer] == [1.0, 2.0]


async def test_self_calls_while_an_instance_is_free_just_queue() -> None:
    h = Harness(BatchingPolicy(max_batch_size=8), instances=2)
    outer = _submit(h, 1.0)
    await settle()
    calls = [_submit(h, 2.0, (("m", 1, "i0"),)), _submit(h, 3.0, (("m", 1, "i0"),))]
    await settle()  # the first runs on i1; the second waits for it, refused by nothing
    assert h.stats.pending == 1 and not any(call.done() for call in calls)
    for _ in range(2):
        h.instances[1].finish()
        await settle()
    assert [(await call)["OUT0"][0, 0] for call in calls] == [2.0, 3.0]
    h.instances[0].finish()
    await outer
