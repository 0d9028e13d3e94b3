"""The front-end's side of BLS: a worker's BlsCall run against the server, answered with BlsReplies."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import numpy as np
import pytest

from geserve.errors import ErrorCode, GeserveError, InvalidArgumentError
from geserve.residency import SharedTensor
from geserve.types import CallChain, InferRequest
from geserve.workers.bls_serving import TIMEOUT_EXPIRED, BlsServer, ModelCaller, serve_call
from geserve.workers.messages import BlsCall, BlsReply
from geserve.workers.runs import RunId
from geserve.workers.shm import take_tensors, write_tensors
from geserve.workers.streams import StreamItem
from tests.conftest import geserve_segments

RUN = RunId.current()


class Doubler:
    """A server with one model that doubles its input; `delay_s` holds each answer back."""

    def __init__(self, delay_s: float = 0.0, stream_final: bool = True) -> None:
        self.requests: list[InferRequest] = []
        self.chains: list[CallChain] = []
        self._delay_s = delay_s
        self._stream_final = stream_final

    async def call_model(self, request: InferRequest, chain: CallChain = ()) -> dict[str, SharedTensor]:
        self.requests.append(request)
        self.chains.append(chain)
        await asyncio.sleep(self._delay_s)
        if request.model_name != "double":
            raise InvalidArgumentError(f"unknown model '{request.model_name}'")
        return {"OUT": SharedTensor.local(np.asarray(request.inputs[0].data) * 2)}

    async def stream_model(self, request: InferRequest, chain: CallChain = ()) -> AsyncIterator[StreamItem]:
        outputs = await self.call_model(request, chain)
        yield outputs, None, False
        yield outputs, None, self._stream_final


def _call(model: str = "double", timeout_us: int = 0, decoupled: bool = False) -> BlsCall:
    inputs = write_tensors({"IN": np.arange(4, dtype=np.int32)}, RUN.segment_name("bls"))
    return BlsCall(7, model, "", inputs, ("OUT",), "r1", {"priority": 1}, timeout_us, decoupled)


def _serve(caller: ModelCaller | None, call: BlsCall) -> list[BlsReply]:
    replies: list[BlsReply] = []
    asyncio.run(serve_call(caller, call, replies.append, RUN))
    return replies


def _own_segments() -> set[str]:
    """This process's BLS segments (other servers on the machine have segments of their own)."""
    return {name for name in geserve_segments() if name.startswith(RUN.prefix)}


@pytest.fixture(autouse=True)
def no_segment_left() -> Iterator[None]:
    before = _own_segments()
    yield
    assert _own_segments() - before == set()


def test_a_call_becomes_a_request_and_its_outputs_come_back_in_shared_memory() -> None:
    caller = Doubler()
    [reply] = _serve(caller, _call())
    assert (reply.call_id, reply.error, reply.final) == (7, None, True)
    np.testing.assert_array_equal(take_tensors(reply.outputs)["OUT"], np.arange(4, dtype=np.int32) * 2)
    [request] = caller.requests
    assert (request.model_name, request.model_version, request.id) == ("double", "", "r1")
    assert [i.name for i in request.inputs] == ["IN"] and request.inputs[0].datatype == "INT32"
    assert [o.name for o in request.outputs] == ["OUT"] and request.parameters == {"priority": 1}


def test_the_servers_error_is_the_reply() -> None:
    [reply] = _serve(Doubler(), _call("missing"))
    assert isinstance(reply.error, GeserveError) and reply.error.code is ErrorCode.INVALID_ARG
    assert reply.outputs == () and reply.final


def test_without_a_server_the_call_is_unavailable_and_its_inputs_are_still_removed() -> None:
    [reply] = _serve(None, _call())
    assert reply.error is not None and reply.error.code is ErrorCode.UNAVAILABLE and reply.final


def test_a_timeout_that_runs_out_answers_as_triton_does() -> None:
    [reply] = _serve(Doubler(delay_s=1.0), _call(timeout_us=10_000))
    assert reply.error is not None and reply.error.message == TIMEOUT_EXPIRED and reply.final


def test_a_decoupled_call_gets_every_response_and_a_final_one_even_if_the_stream_sends_none() -> None:
    for stream_final, count in ((True, 2), (False, 3)):
        replies = _serve(Doubler(stream_final=stream_final), _call(decoupled=True))
        assert len(replies) == count and [r.final for r in replies] == [False] * (count - 1) + [True]
        for reply in replies:
            take_tensors(reply.outputs)


@pytest.mark.parametrize("decoupled", [False, True])
def test_each_call_reaches_the_server_with_the_chain_of_the_instance_it_came_from(decoupled: bool) -> None:
    caller = Doubler()
    chains: list[CallChain] = [(("a", 1), ("m", 1)), ()]

    async def serve() -> list[BlsReply | object]:
        replies: list[BlsReply | object] = []
        server = BlsServer(lambda: caller, RUN, lambda: chains[len(caller.chains)])
        for _ in chains:  # the chain is asked as each call arrives
            server(_call(decoupled=decoupled), replies.append)
            await asyncio.gather(*asyncio.all_tasks() - {asyncio.current_task()})  # the call is answered
        return replies

    replies = asyncio.run(serve())
    assert caller.chains == chains
    for reply in replies:
        assert isinstance(reply, BlsReply) and reply.error is None
        take_tensors(reply.outputs)
