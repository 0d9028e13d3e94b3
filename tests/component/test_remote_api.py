"""RemoteInferenceAPI over a real EngineEndpoint in this process: every call answers as the service does in process."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

from geserve._generated import model_config_pb2 as mc
from geserve.core.api import InferenceAPI
from geserve.core.service import InferenceService
from geserve.errors import (
    CancelledError,
    GeserveError,
    InternalError,
    InvalidArgumentError,
    UnavailableError,
)
from geserve.multiprocess.arena import RequestArena
from geserve.multiprocess.calls import LOG_SETTINGS_EVENT
from geserve.multiprocess.endpoint import EngineEndpoint
from geserve.multiprocess.remote import ENGINE_GONE, RemoteInferenceAPI
from geserve.types import InferInput, InferRequest, InferResponse, StreamedResponse, VersionSnapshot
from geserve.workers.handoff import MappedOutputs
from geserve.workers.runs import RunId
from tests.component.conftest import in_process_service
from tests.support import copy_model, write_identity_model

RUN = RunId.current()
ARENA_BYTES = 4 << 20
GATED = "gated"  # a model the engine holds each request of until the test lets it go
LARGE = 8192  # FP32 elements: 32 KiB, over the size that is placed in the arena and sent out of band
HANG_GUARD_S = 10  # only so that a broken channel fails the test instead of hanging it


class Engine:
    """The service as the engine serves it, but for `gated`: such a request waits until cancelled, then until
    `release` (an engine that takes its time to give up), then answers cancelled."""

    def __init__(self, service: InferenceService) -> None:
        self._service = service
        self.requests: list[InferRequest] = []  # every infer request as the engine received it
        self.entered = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.release = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._service, name)

    async def infer(self, request: InferRequest) -> InferResponse:
        self.requests.append(request)
        if request.model_name != GATED:
            return await self._service.infer(request)
        self.entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            await self.release.wait()
            raise
        raise AssertionError("never answered")

    async def infer_stream(self, request: InferRequest) -> AsyncIterator[StreamedResponse]:
        if request.model_name != GATED:
            async for item in self._service.infer_stream(request):
                yield item
            return
        yield StreamedResponse(None, None, False)
        self.entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


@dataclass
class Channel:
    """One engine endpoint on a unix socket and the clients connected to it."""

    service: InferenceService
    engine: Engine
    endpoint: EngineEndpoint
    mapped: MappedOutputs
    path: str
    clients: list[RemoteInferenceAPI] = field(default_factory=list)

    async def connect(
        self, on_event: Callable[[str, Any], None] | None = None, arena: RequestArena | None = None
    ) -> RemoteInferenceAPI:
        client = RemoteInferenceAPI(on_event=on_event, arena=arena)
        await client.connect(self.path)
        self.clients.append(client)
        return client


@pytest.fixture
async def channel(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Channel]:
    write_identity_model(tmp_path, "echo")
    copy_model("simple", tmp_path)
    copy_model("repeat_int32", tmp_path)
    service = await in_process_service(tmp_path, summary_latencies=True, histogram_latencies=True)
    engine = Engine(service)
    mapped = MappedOutputs()
    endpoint = EngineEndpoint(cast(InferenceAPI, engine), mapped)
    path = str(tmp_path_factory.mktemp("channel") / "engine.sock")  # short: unix socket paths are limited
    await endpoint.start(path)
    made = Channel(service, engine, endpoint, mapped, path)
    yield made
    for client in made.clients:
        client.close()
    engine.release.set()
    await endpoint.stop()
    await service.shutdown()


@pytest.fixture
def arena() -> Iterator[RequestArena]:
    made = RequestArena(RUN.segment_name("requests0"), ARENA_BYTES)
    yield made
    made.close()


@pytest.fixture(params=["plain", "arena"])
async def remote(request: pytest.FixtureRequest, channel: Channel, arena: RequestArena) -> RemoteInferenceAPI:
    """A protocol process's client: tensors in the channel's messages, or placed in its arena."""
    return await channel.connect(arena=arena if request.param == "arena" else None)


def _arena_of(remote: RemoteInferenceAPI) -> RequestArena | None:
    return remote._arena


def _echo(values: np.ndarray, request_id: str = "", binary: bool = True) -> InferRequest:
    data: np.ndarray | memoryview = memoryview(values.tobytes()) if binary else values
    return InferRequest("echo", "", (InferInput("INPUT0", "FP32", values.shape, data),), id=request_id)


def _values(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, count)).astype(np.float32)


async def _outcome(call: Awaitable[Any]) -> tuple[Any, ...]:
    """What a call gave: its value, or its error's class and message."""
    try:
        value = await call
    except GeserveError as error:
        return ("error", type(error), error.message)
    if isinstance(value, InferResponse):
        outputs = tuple((o.name, o.datatype, o.shape, o.data.tobytes()) for o in value.outputs)
        return ("response", value.model_name, value.model_version, value.id, outputs)
    return ("value", value)


async def _assert_good_request_served(remote: RemoteInferenceAPI) -> None:
    values = _values(LARGE, 99)
    response = await remote.infer(_echo(values, "good"))
    assert response.id == "good"
    np.testing.assert_array_equal(response.outputs[0].data, values)


# -- health, metadata, repository ----------------------------------------------------------


async def test_health_and_metadata_answer_as_in_process(remote: RemoteInferenceAPI, channel: Channel) -> None:
    service = channel.service
    assert await remote.live() is True and await remote.ready() is True
    assert await remote.server_metadata() == await service.server_metadata()
    for name, version in (("echo", ""), ("echo", "1"), ("echo", "2"), ("simple", ""), ("nope", "")):
        assert await _outcome(remote.model_ready(name, version)) == await _outcome(service.model_ready(name, version))
    assert await remote.model_ready("echo", "1") and not await remote.model_ready("echo", "2")
    for name in ("echo", "simple", "repeat_int32"):
        assert await remote.model_metadata(name) == await service.model_metadata(name)
        config = await remote.model_config(name)
        assert isinstance(config, mc.ModelConfig) and config == await service.model_config(name)
    assert (await remote.model_config("simple")).max_batch_size == 8
    assert (await remote.model_config("repeat_int32")).model_transaction_policy.decoupled
    assert await remote.repository_index() == await service.repository_index()
    assert await remote.repository_index(ready_only=True) == await service.repository_index(ready_only=True)


async def test_repository_control_reaches_the_engine(remote: RemoteInferenceAPI, channel: Channel) -> None:
    await remote.unload_model("echo")
    assert not await channel.service.model_ready("echo") and not await remote.model_ready("echo")
    unloaded = await _outcome(remote.infer(_echo(_values(4, 1))))
    assert unloaded[0] == "error" and unloaded == await _outcome(channel.service.infer(_echo(_values(4, 1))))
    await remote.load_model("echo", {})
    assert await channel.service.model_ready("echo")
    await _assert_good_request_served(remote)


async def test_settings_and_shared_memory_status_answer_as_in_process(
    remote: RemoteInferenceAPI, channel: Channel
) -> None:
    service = channel.service
    assert await remote.shared_memory_status() == await service.shared_memory_status() == []
    assert await remote.cuda_shared_memory_status() == await service.cuda_shared_memory_status()
    changed = await remote.update_trace_settings(None, {"trace_rate": "10"})
    assert changed == await service.trace_settings() and changed["trace_rate"] == "10"
    assert await remote.trace_settings("echo") == await service.trace_settings("echo")
    assert await remote.log_settings() == await service.log_settings()
    assert await remote.device_usage() == await service.device_usage()
    assert await remote.custom_metrics() == await service.custom_metrics()


# -- inference -----------------------------------------------------------------------------


@pytest.mark.parametrize("count", [4, 3000, LARGE, 1 << 17])
async def test_binary_inputs_come_back_with_their_values(
    remote: RemoteInferenceAPI, channel: Channel, count: int
) -> None:
    values = _values(count, count)
    local = await _outcome(channel.service.infer(_echo(values, f"r{count}")))
    assert await _outcome(remote.infer(_echo(values, f"r{count}"))) == local
    response = await remote.infer(_echo(values, "again"))
    assert response.id == "again" and response.model_name == "echo"
    np.testing.assert_array_equal(response.outputs[0].data, values)


async def test_large_inputs_reach_the_engine_in_the_arena(remote: RemoteInferenceAPI, channel: Channel) -> None:
    values = _values(LARGE, 2)
    await remote.infer(_echo(values))
    received = channel.engine.requests[-1].inputs[0].data
    arena = _arena_of(remote)
    where = channel.mapped.ref_of(received) if isinstance(received, np.ndarray) else None
    if arena is None:
        assert where is None  # in the message: the engine has the bytes of the frame
    else:
        # In place: an array of the mapping, which a worker would be given by reference.
        assert isinstance(received, np.ndarray) and received.dtype == np.float32 and received.shape == values.shape
        assert where is not None and where.segment == arena.name
    np.testing.assert_array_equal(np.frombuffer(received, np.float32).reshape(values.shape), values)


async def test_numpy_inputs_give_exact_outputs(remote: RemoteInferenceAPI, channel: Channel) -> None:
    first = np.arange(16, dtype=np.int32).reshape(1, 16)
    second = np.full((1, 16), 3, dtype=np.int32)
    request = InferRequest(
        "simple",
        "",
        (InferInput("INPUT0", "INT32", (1, 16), first), InferInput("INPUT1", "INT32", (1, 16), second)),
        id="sum",
    )
    response = await remote.infer(request)
    outputs = {output.name: output.data for output in response.outputs}
    np.testing.assert_array_equal(outputs["OUTPUT0"], first + second)
    np.testing.assert_array_equal(outputs["OUTPUT1"], first - second)
    assert response.id == "sum" and outputs["OUTPUT0"].dtype == np.int32
    assert await _outcome(remote.infer(request)) == await _outcome(channel.service.infer(request))
    values = _values(LARGE, 3)
    assert await _outcome(remote.infer(_echo(values, binary=False))) == await _outcome(
        channel.service.infer(_echo(values, binary=False))
    )


def _bad_calls() -> list[tuple[str, Callable[[InferenceAPI], Awaitable[Any]]]]:
    wrong_type = InferRequest("echo", "", (InferInput("INPUT0", "INT32", (1, 4), np.zeros((1, 4), np.int32)),))
    too_few = _values(LARGE, 4)
    wrong_shape = InferRequest(
        "echo", "", (InferInput("INPUT0", "FP32", (1, LARGE + 1), memoryview(too_few.tobytes())),), id="shape"
    )
    missing = InferRequest("simple", "", (InferInput("INPUT0", "INT32", (1, 16), np.zeros((1, 16), np.int32)),))
    return [
        ("unknown model", lambda api: api.infer(replace_model(_echo(_values(LARGE, 5), "bad"), "nope"))),
        ("wrong datatype", lambda api: api.infer(wrong_type)),
        ("bytes that do not fill the shape", lambda api: api.infer(wrong_shape)),
        ("a missing input", lambda api: api.infer(missing)),
        ("unknown version", lambda api: api.model_metadata("echo", "7")),
        ("config of an unknown model", lambda api: api.model_config("nope")),
        ("trace settings of an unknown model", lambda api: api.trace_settings("nope")),
        ("client shared memory not allowed", lambda api: api.register_shared_memory("r", "/x", 0, 16)),
        ("registering cuda memory", lambda api: api.register_cuda_shared_memory()),
        ("unknown log setting", lambda api: api.update_log_settings({"nope": 1})),
    ]


def replace_model(request: InferRequest, name: str) -> InferRequest:
    return InferRequest(name, request.model_version, request.inputs, request.outputs, request.id)


async def test_errors_arrive_as_the_same_error_and_the_next_request_is_served(
    remote: RemoteInferenceAPI, channel: Channel
) -> None:
    for case, call in _bad_calls():
        local = await _outcome(call(channel.service))
        over_channel = await _outcome(call(remote))
        assert local[0] == "error", f"{case} is not an error in process"
        assert over_channel == local, case
        await _assert_good_request_served(remote)


async def test_only_interface_methods_can_be_called(remote: RemoteInferenceAPI, channel: Channel) -> None:
    for method in ("shutdown", "_service", "infer_stream", "kill"):
        with pytest.raises(InternalError, match=f"the engine has no call '{method}'"):
            await remote._call(method)
    assert await channel.service.live()
    await _assert_good_request_served(remote)


async def test_statistics_count_what_came_over_the_channel(remote: RemoteInferenceAPI, channel: Channel) -> None:
    for seed in range(3):
        await remote.infer(_echo(_values(LARGE, seed)))
    assert await remote.statistics("echo", "1") == await channel.service.statistics("echo", "1")
    [entry] = await remote.statistics("echo", "1")
    assert entry["inference_stats"]["success"]["count"] == 3
    assert await remote.statistics() == await channel.service.statistics()
    versions = await remote.version_statistics()
    assert repr(versions) == repr(await channel.service.version_statistics())  # quantiles may be NaN
    echo = next(snapshot for snapshot in versions if snapshot.name == "echo")
    assert isinstance(echo, VersionSnapshot) and echo.success.count == 3 and echo.histogram is not None


async def test_concurrent_infers_are_each_answered_with_their_own_values(
    remote: RemoteInferenceAPI, channel: Channel
) -> None:
    # 200 of 24 KiB each: more than the arena holds at once, so some go in their messages instead.
    requests = [(index, _values(6000 + index % 7, index)) for index in range(200)]
    responses = await asyncio.wait_for(
        asyncio.gather(*(remote.infer(_echo(values, f"c{index}")) for index, values in requests)), HANG_GUARD_S
    )
    for (index, values), response in zip(requests, responses, strict=True):
        assert response.id == f"c{index}"
        np.testing.assert_array_equal(response.outputs[0].data, values)
    assert remote._calls == {} and remote._kept == {}
    arena = _arena_of(remote)
    if arena is not None:
        received = [request.inputs[0].data for request in channel.engine.requests]
        in_place = sum(isinstance(data, np.ndarray) and channel.mapped.ref_of(data) is not None for data in received)
        assert 0 < in_place < len(requests)  # the arena filled up: the others went in their messages
        del responses, received
        channel.engine.requests.clear()
        gc.collect()
        assert arena.allocate(ARENA_BYTES) is not None  # every block free again


# -- log settings --------------------------------------------------------------------------


async def test_log_settings_changes_reach_every_client(channel: Channel, arena: RequestArena) -> None:
    heard: dict[str, list[tuple[str, Any]]] = {"first": [], "second": []}
    second_heard = asyncio.Event()

    def on_second(name: str, value: Any) -> None:
        heard["second"].append((name, value))
        second_heard.set()

    first = await channel.connect(on_event=lambda name, value: heard["first"].append((name, value)))
    await channel.connect(on_event=on_second, arena=arena)
    try:
        changed = await first.update_log_settings({"log_verbose_level": 1})
        assert changed == await channel.service.log_settings() and changed["log_verbose_level"] == 1
        await asyncio.wait_for(second_heard.wait(), HANG_GUARD_S)
        assert heard["second"] == [(LOG_SETTINGS_EVENT, changed)]
        assert heard["first"] == [(LOG_SETTINGS_EVENT, changed)]  # the caller's own process too
        assert await first.log_settings() == changed
    finally:
        await channel.service.update_log_settings({"log_verbose_level": 0})
    await _assert_good_request_served(first)


async def test_a_call_that_fails_changes_no_log_settings_and_tells_no_one(channel: Channel) -> None:
    heard: list[tuple[str, Any]] = []
    client = await channel.connect(on_event=lambda name, value: heard.append((name, value)))
    before = await client.log_settings()
    with pytest.raises(InvalidArgumentError):
        await client.update_log_settings({"nope": 1})
    assert await client.log_settings() == before and heard == []


# -- cancellation and a lost engine --------------------------------------------------------


def _gated(values: np.ndarray) -> InferRequest:
    return InferRequest(GATED, "", (InferInput("INPUT0", "FP32", values.shape, memoryview(values.tobytes())),))


async def test_a_cancelled_call_is_cancelled_in_the_engine(remote: RemoteInferenceAPI, channel: Channel) -> None:
    engine = channel.engine
    values = _values(LARGE, 6)
    waiting = asyncio.ensure_future(remote.infer(_gated(values)))
    await asyncio.wait_for(engine.entered.wait(), HANG_GUARD_S)
    arena = _arena_of(remote)
    assert len(remote._kept) == (1 if arena is not None else 0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await asyncio.wait_for(engine.cancelled.wait(), HANG_GUARD_S)  # the engine's task was cancelled
    # Until the engine answers, the request's block stays taken: the engine may still be reading it. Every free
    # block is overwritten now, and what the engine received is unchanged.
    gc.collect()
    fillers: list[np.ndarray] = []
    if arena is not None:
        assert len(remote._kept) == 1
        fillers = _overwrite_free_blocks(arena)
        assert fillers
    received = engine.requests[-1].inputs[0].data
    np.testing.assert_array_equal(np.frombuffer(received, np.float32).reshape(values.shape), values)
    fillers.clear()
    engine.release.set()
    await asyncio.wait_for(_until(lambda: not remote._kept), HANG_GUARD_S)
    assert remote._calls == {}
    await _assert_good_request_served(remote)
    if arena is not None:
        del received, waiting  # the cancelled call's traceback holds its frame, and the frame its block
        engine.requests.clear()
        gc.collect()
        assert arena.allocate(ARENA_BYTES) is not None


def _overwrite_free_blocks(arena: RequestArena) -> list[np.ndarray]:
    """Every free block of the arena, taken and overwritten."""
    taken = []
    while (block := arena.allocate(64 << 10)) is not None:
        block[:] = 0xFF
        taken.append(block)
    return taken


async def _until(condition: Callable[[], bool]) -> None:
    while not condition():  # noqa: ASYNC110 - client state, with no event to wait on
        await asyncio.sleep(0.01)


async def test_an_answer_after_the_caller_gave_up_is_dropped(remote: RemoteInferenceAPI, channel: Channel) -> None:
    channel.engine.release.set()  # the engine gives up at once: its cancelled answer comes back
    waiting = asyncio.ensure_future(remote.infer(_gated(_values(4, 7))))
    await asyncio.wait_for(channel.engine.entered.wait(), HANG_GUARD_S)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await asyncio.wait_for(channel.engine.cancelled.wait(), HANG_GUARD_S)
    await _assert_good_request_served(remote)
    assert remote._calls == {} and remote._kept == {}


async def test_the_engine_answers_cancelled_when_its_call_is_cancelled_there(channel: Channel) -> None:
    # The engine's own cancellation (a connection that went away, or a cancel) is answered, not swallowed.
    client = await channel.connect()
    channel.engine.release.set()
    waiting = asyncio.ensure_future(client.infer(_gated(_values(4, 8))))
    await asyncio.wait_for(channel.engine.entered.wait(), HANG_GUARD_S)
    [connection] = channel.endpoint._connections
    [task] = connection._tasks.values()
    task.cancel()
    with pytest.raises(CancelledError, match="the request was cancelled"):
        await asyncio.wait_for(waiting, HANG_GUARD_S)
    await _assert_good_request_served(client)


async def test_a_closed_engine_fails_every_pending_and_later_call(remote: RemoteInferenceAPI, channel: Channel) -> None:
    channel.engine.release.set()
    pending = [asyncio.ensure_future(remote.infer(_gated(_values(LARGE, seed)))) for seed in range(3)]
    await asyncio.wait_for(channel.engine.entered.wait(), HANG_GUARD_S)
    stream = remote.infer_stream(replace_model(_repeat([1]), GATED))
    assert (await anext(stream)).final is False  # a stream in flight, part read
    await channel.endpoint.stop()
    await asyncio.wait_for(remote.lost.wait(), HANG_GUARD_S)
    for call in pending:
        with pytest.raises(UnavailableError, match=ENGINE_GONE):
            await asyncio.wait_for(call, HANG_GUARD_S)
    assert remote._calls == {} and remote._kept == {}
    with pytest.raises(UnavailableError, match=ENGINE_GONE):
        async for _ in stream:
            pass
    with pytest.raises(UnavailableError, match=ENGINE_GONE):
        await remote.live()
    with pytest.raises(UnavailableError, match=ENGINE_GONE):
        await remote.infer(_echo(_values(LARGE, 9)))
    with pytest.raises(UnavailableError, match=ENGINE_GONE):
        await anext(remote.infer_stream(_repeat([1], delay_ms=0)))


# -- streams -------------------------------------------------------------------------------


def _repeat(values: list[int], delay_ms: int = 0, request_id: str = "") -> InferRequest:
    count = len(values)
    inputs = (
        InferInput("IN", "INT32", (count,), np.array(values, np.int32)),
        InferInput("DELAY", "UINT32", (count,), np.full(count, delay_ms, np.uint32)),
        InferInput("WAIT", "UINT32", (1,), np.zeros(1, np.uint32)),
    )
    return InferRequest("repeat_int32", "", inputs, id=request_id)


def _summary(item: StreamedResponse) -> tuple[Any, ...]:
    outputs = None
    if item.response is not None:
        outputs = tuple((o.name, o.data.tolist()) for o in item.response.outputs)
    error = None if item.error is None else (type(item.error), item.error.message)
    return outputs, error, item.final


async def _stream(api: InferenceAPI, request: InferRequest) -> list[tuple[Any, ...]] | tuple[Any, ...]:
    try:
        return [_summary(item) async for item in api.infer_stream(request)]
    except GeserveError as error:
        return ("error", type(error), error.message)


async def test_streams_answer_as_in_process(remote: RemoteInferenceAPI, channel: Channel) -> None:
    request = _repeat([4, 5, 6], request_id="s1")
    items = await asyncio.wait_for(_stream(remote, request), HANG_GUARD_S)
    assert items == await _stream(channel.service, request)
    assert isinstance(items, list) and [outputs for outputs, _, _ in items if outputs] == [
        (("OUT", [value]), ("IDX", [index])) for index, value in enumerate([4, 5, 6])
    ]
    assert items[-1][2] is True  # the final flag closes it
    assert remote._streams == {} and remote._kept == {}


@pytest.mark.parametrize(
    "request_of",
    [
        lambda: replace_model(_repeat([1]), "nope"),  # refused before the stream starts
        lambda: InferRequest("repeat_int32", "", _repeat([1, 2]).inputs[:1]),  # a missing input
        lambda: InferRequest(  # the model's own error, in the stream
            "repeat_int32",
            "",
            (
                InferInput("IN", "INT32", (2,), np.array([1, 2], np.int32)),
                InferInput("DELAY", "UINT32", (3,), np.zeros(3, np.uint32)),
                InferInput("WAIT", "UINT32", (1,), np.zeros(1, np.uint32)),
            ),
        ),
    ],
    ids=["unknown model", "missing input", "model error"],
)
async def test_stream_errors_answer_as_in_process(
    remote: RemoteInferenceAPI, channel: Channel, request_of: Callable[[], InferRequest]
) -> None:
    over_channel = await asyncio.wait_for(_stream(remote, request_of()), HANG_GUARD_S)
    assert over_channel == await _stream(channel.service, request_of())
    good = await asyncio.wait_for(_stream(remote, _repeat([7])), HANG_GUARD_S)
    assert isinstance(good, list) and good[0][0] == (("OUT", [7]), ("IDX", [0]))


async def test_a_stream_left_early_is_cancelled_and_the_next_served(remote: RemoteInferenceAPI) -> None:
    stream = remote.infer_stream(_repeat(list(range(50)), delay_ms=1))
    first = await asyncio.wait_for(anext(stream), HANG_GUARD_S)
    assert first.response is not None and first.response.outputs[0].data.tolist() == [0]
    await stream.aclose()  # the client went away
    assert remote._streams == {}
    items = await asyncio.wait_for(_stream(remote, _repeat([8, 9])), HANG_GUARD_S)
    assert isinstance(items, list) and [o for o, _, _ in items if o] == [
        (("OUT", [8]), ("IDX", [0])),
        (("OUT", [9]), ("IDX", [1])),
    ]


async def test_a_stream_left_early_is_cancelled_in_the_engine(remote: RemoteInferenceAPI, channel: Channel) -> None:
    stream = remote.infer_stream(replace_model(_repeat([1]), GATED))
    assert (await asyncio.wait_for(anext(stream), HANG_GUARD_S)).final is False
    await asyncio.wait_for(channel.engine.entered.wait(), HANG_GUARD_S)
    await stream.aclose()
    await asyncio.wait_for(channel.engine.cancelled.wait(), HANG_GUARD_S)
    await asyncio.wait_for(_until(lambda: not remote._kept), HANG_GUARD_S)
    assert remote._streams == {}
    await _assert_good_request_served(remote)
