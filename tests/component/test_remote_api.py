"""A FrontDoor and RemoteEngineLink over a real EngineEndpoint in this process: they answer as one process does."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import secrets
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

from geserve._generated import model_config_pb2 as mc
from geserve.core.api import InferenceAPI
from geserve.core.local_link import LocalEngineLink
from geserve.core.service import InferenceService
from geserve.errors import (
    CancelledError,
    GeserveError,
    InternalError,
    InvalidArgumentError,
    UnavailableError,
)
from geserve.frontdoor.arena import RequestArena
from geserve.frontdoor.placement import Placement
from geserve.frontdoor.service import FrontDoor
from geserve.multiprocess.calls import LOG_SETTINGS_EVENT
from geserve.multiprocess.endpoint import EngineEndpoint, _Connection
from geserve.multiprocess.remote import ENGINE_GONE, RemoteEngineLink
from geserve.residency import SHM_DIRECTORY, Kind, SharedTensor
from geserve.settings import ControlMode, MetricsSettings, RepositorySettings, ServerSettings, WorkerSettings
from geserve.snapshots import snapshot_of
from geserve.submissions import Answer, Submission
from geserve.types import (
    InferInput,
    InferRequest,
    InferResponse,
    RequestedOutput,
    StreamedResponse,
    VersionSnapshot,
)
from geserve.workers.pool import InstancePools
from geserve.workers.runs import RunId
from tests.component.conftest import in_process_service
from tests.support import copy_model, write_identity_model

RUN = RunId.current()
ARENA_BYTES = 4 << 20
GATED = "gated"  # a model the engine holds each request of until the test lets it go
LARGE = 8192  # FP32 elements: 32 KiB, over the size a frame carries in its pickle
HANG_GUARD_S = 10  # only so that a broken channel fails the test instead of hanging it

Done = Callable[[Answer | GeserveError], None]


class Engine:
    """The service as the endpoint serves it, recording every submission it is handed, but for `gated`: such a
    request waits until cancelled, then until `release` (an engine that takes its time to give up), then answers
    cancelled."""

    def __init__(self, service: InferenceService) -> None:
        self._service = service
        self.submissions: list[Submission] = []  # every submission as the engine received it
        self.entered = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.release = asyncio.Event()
        self.giving_up: set[asyncio.Task[None]] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._service, name)

    def submit(self, submission: Submission, done: Done) -> Callable[[], None]:
        self.submissions.append(submission)
        if submission.model_name != GATED:
            return self._service.submit(submission, done)
        self.entered.set()

        def cancel() -> None:
            if not self.cancelled.is_set():
                self.cancelled.set()
                task = asyncio.get_running_loop().create_task(self._give_up(submission, done))
                self.giving_up.add(task)

        return cancel

    async def _give_up(self, submission: Submission, done: Done) -> None:
        await self.release.wait()
        done(CancelledError("the request was cancelled").with_request_id(submission.request_id))

    async def stream_submission(self, submission: Submission) -> AsyncIterator[Answer]:
        self.submissions.append(submission)
        if submission.model_name != GATED:
            async for answer in self._service.stream_submission(submission):
                yield answer
            return
        yield Answer(None, "1", final=False)
        self.entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


@dataclass
class Remote:
    """A protocol process: its front door, its link to the engine, and the arena it places inputs in (or none:
    every input then gets a segment of its own)."""

    door: FrontDoor
    link: RemoteEngineLink
    arena: RequestArena | None


@dataclass
class Channel:
    """One engine endpoint on a unix socket, the protocol processes connected to it, and the engine's service as the
    one-process server serves it (`local`), to compare with."""

    service: InferenceService
    engine: Engine
    endpoint: EngineEndpoint
    path: str
    arena: RequestArena
    local: FrontDoor
    remotes: list[Remote] = field(default_factory=list)

    async def connect(self, on_event: Callable[[str, Any], None] | None = None, arena: bool = False) -> Remote:
        link = RemoteEngineLink(on_event=on_event)
        await asyncio.wait_for(link.connect(self.path), HANG_GUARD_S)
        placed_in = self.arena if arena else None
        remote = Remote(FrontDoor(link, Placement(placed_in, RUN)), link, placed_in)
        self.remotes.append(remote)
        return remote

    def connection(self) -> _Connection:
        """The engine's end of the one protocol process connected."""
        [connection] = self.endpoint._connections
        return connection


def _run_segments() -> set[str]:
    """This run's shared-memory segments: arenas, inputs placed on their own, workers' segments."""
    return {path.name for path in SHM_DIRECTORY.iterdir() if path.name.startswith(RUN.prefix)}


def _input_segments() -> set[str]:
    """Segments made for one request's input (the arena was full, or there is none)."""
    return {name for name in _run_segments() if name.endswith("_in")}


@contextlib.asynccontextmanager
async def _channel(service: InferenceService, socket_folder: Path) -> AsyncIterator[Channel]:
    before = _run_segments()
    engine = Engine(service)
    endpoint = EngineEndpoint(cast(InferenceService, engine))
    path = str(socket_folder / "engine.sock")  # short: unix socket paths are limited
    await endpoint.start(path)
    arena = RequestArena(RUN.segment_name("requests0"), ARENA_BYTES)
    local = FrontDoor(LocalEngineLink(service), Placement(None, RUN))
    made = Channel(service, engine, endpoint, path, arena, local)
    try:
        yield made
    finally:
        for remote in made.remotes:
            remote.link.close()
        engine.release.set()
        await endpoint.stop()
        await asyncio.gather(*engine.giving_up)
        await service.shutdown()
        arena.close()
        made.remotes.clear()
        engine.submissions.clear()
        await asyncio.sleep(0)
        gc.collect()
        leftover = _run_segments() - before
        for name in leftover:
            (SHM_DIRECTORY / name).unlink(missing_ok=True)
        assert not leftover, "every shared-memory segment is removed once the channel is gone"


async def _served(repository: Path, server: ServerSettings | None = None) -> InferenceService:
    """`echo` and `gated` (identity, FP32 [-1], batching), `simple` (ONNX, INT32 add/sub) and `repeat_int32`
    (decoupled), on threads of this process."""
    write_identity_model(repository, "echo")
    write_identity_model(repository, GATED)
    copy_model("simple", repository)
    copy_model("repeat_int32", repository)
    return await in_process_service(repository, server, summary_latencies=True, histogram_latencies=True)


@pytest.fixture
async def channel(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Channel]:
    service = await _served(tmp_path)
    async with _channel(service, tmp_path_factory.mktemp("channel")) as made:
        yield made


@pytest.fixture(params=["segments", "arena"])
async def remote(request: pytest.FixtureRequest, channel: Channel) -> Remote:
    """A protocol process: inputs in segments of their own, or placed in its request arena."""
    return await channel.connect(arena=request.param == "arena")


def _echo(values: np.ndarray, request_id: str = "", binary: bool = True, model: str = "echo") -> InferRequest:
    data: np.ndarray | memoryview = memoryview(values.tobytes()) if binary else values
    return InferRequest(model, "", (InferInput("INPUT0", "FP32", values.shape, data),), id=request_id)


def _values(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, count)).astype(np.float32)


def _array(tensor: SharedTensor) -> np.ndarray:
    """A tensor the engine received, read where it lies (as a worker would)."""
    return SharedTensor(tensor.datatype, tensor.shape, tensor.where).array


async def _outcome(call: Awaitable[Any]) -> tuple[Any, ...]:
    """What a call gave: its value, or its error's class and message."""
    try:
        value = await call
    except GeserveError as error:
        return ("error", type(error), error.message)
    if isinstance(value, InferResponse):
        outputs = tuple((o.name, o.datatype, o.shape, o.data.tobytes(), o.parameters) for o in value.outputs)
        return ("response", value.model_name, value.model_version, value.id, outputs, value.parameters)
    return ("value", value)


async def _assert_good_request_served(remote: Remote) -> None:
    values = _values(LARGE, 99)
    response = await asyncio.wait_for(remote.door.infer(_echo(values, "good")), HANG_GUARD_S)
    assert response.id == "good"
    np.testing.assert_array_equal(response.outputs[0].data, values)


async def _until(condition: Callable[[], bool]) -> None:
    async def poll() -> None:
        while not condition():  # noqa: ASYNC110 - state of the link or endpoint, with no event to wait on
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), HANG_GUARD_S)


async def _assert_inputs_freed(arena: RequestArena | None) -> None:
    """Every block of the arena is free again and every segment made for one input removed: the requests that held
    them are gone (once the loop has dropped what its last turn held of them)."""
    await asyncio.sleep(0)
    gc.collect()
    if arena is not None:
        assert arena.allocate(ARENA_BYTES) is not None
    assert _input_segments() == set()


# -- health, metadata, repository ----------------------------------------------------------


async def test_health_and_metadata_answer_as_in_process(remote: Remote, channel: Channel) -> None:
    door, local = remote.door, channel.local
    assert await door.live() is True and await door.ready() is True
    assert await door.server_metadata() == await local.server_metadata()
    for name, version in (("echo", ""), ("echo", "1"), ("echo", "2"), ("simple", ""), ("nope", "")):
        assert await _outcome(door.model_ready(name, version)) == await _outcome(local.model_ready(name, version))
    assert await door.model_ready("echo", "1") and not await door.model_ready("echo", "2")
    for name in ("echo", "simple", "repeat_int32"):
        assert await door.model_metadata(name) == await local.model_metadata(name)
        config = await door.model_config(name)
        assert isinstance(config, mc.ModelConfig) and config == await local.model_config(name)
    assert (await door.model_config("simple")).max_batch_size == 8
    assert (await door.model_config("repeat_int32")).model_transaction_policy.decoupled
    assert await door.repository_index() == await local.repository_index()
    assert await door.repository_index(ready_only=True) == await local.repository_index(ready_only=True)


async def test_repository_control_reaches_the_engine(remote: Remote, channel: Channel) -> None:
    await remote.door.unload_model("echo")
    assert not await channel.service.model_ready("echo") and not await remote.door.model_ready("echo")
    unloaded = await _outcome(remote.door.infer(_echo(_values(4, 1))))
    assert unloaded[0] == "error" and unloaded == await _outcome(channel.local.infer(_echo(_values(4, 1))))
    await remote.door.load_model("echo", {})
    assert await channel.service.model_ready("echo")
    await _assert_good_request_served(remote)


async def test_settings_and_shared_memory_status_answer_as_in_process(remote: Remote, channel: Channel) -> None:
    door, local = remote.door, channel.local
    assert await door.shared_memory_status() == await local.shared_memory_status() == []
    assert await door.cuda_shared_memory_status() == await local.cuda_shared_memory_status()
    changed = await door.update_trace_settings(None, {"trace_rate": "10"})
    assert changed == await local.trace_settings() and changed["trace_rate"] == "10"
    assert await door.trace_settings("echo") == await local.trace_settings("echo")
    assert await door.log_settings() == await local.log_settings()
    assert await door.device_usage() == await local.device_usage()
    assert await door.custom_metrics() == await local.custom_metrics()
    assert await door.cache_statistics() == await local.cache_statistics()


# -- inference -----------------------------------------------------------------------------


@pytest.mark.parametrize("count", [4, 3000, LARGE, 1 << 17])
async def test_binary_inputs_come_back_with_their_values(remote: Remote, channel: Channel, count: int) -> None:
    values = _values(count, count)
    local = await _outcome(channel.local.infer(_echo(values, f"r{count}")))
    assert await _outcome(remote.door.infer(_echo(values, f"r{count}"))) == local
    response = await remote.door.infer(_echo(values, "again"))
    assert response.id == "again" and response.model_name == "echo" and response.model_version == "1"
    np.testing.assert_array_equal(response.outputs[0].data, values)


async def test_large_inputs_reach_the_engine_through_the_arena(remote: Remote, channel: Channel) -> None:
    values = _values(LARGE, 2)
    response = await remote.door.infer(_echo(values))
    np.testing.assert_array_equal(response.outputs[0].data, values)
    [submission] = channel.engine.submissions
    [(name, received)] = submission.inputs
    assert name == "INPUT0" and received.where is not None and received.shape == values.shape
    if remote.arena is None:
        # A segment of its own, removed once the request is answered and gone.
        assert received.where.kind == Kind.ONE_OFF and received.where.segment.endswith("_in")
        del response
        await _assert_inputs_freed(None)
        assert not (SHM_DIRECTORY / received.where.segment).exists()
    else:
        # In place, in the protocol process's arena: the engine is told where, never handed the bytes.
        assert received.where.kind == Kind.ARENA and received.where.segment == remote.arena.name
        assert received.where.nbytes == values.nbytes
        np.testing.assert_array_equal(_array(received), values)
        assert _input_segments() == set()


async def test_numpy_inputs_give_exact_outputs(remote: Remote, channel: Channel) -> None:
    first = np.arange(16, dtype=np.int32).reshape(1, 16)
    second = np.full((1, 16), 3, dtype=np.int32)
    request = InferRequest(
        "simple",
        "",
        (InferInput("INPUT0", "INT32", (1, 16), first), InferInput("INPUT1", "INT32", (1, 16), second)),
        id="sum",
    )
    response = await remote.door.infer(request)
    outputs = {output.name: output.data for output in response.outputs}
    np.testing.assert_array_equal(outputs["OUTPUT0"], first + second)
    np.testing.assert_array_equal(outputs["OUTPUT1"], first - second)
    assert response.id == "sum" and outputs["OUTPUT0"].dtype == np.int32
    assert await _outcome(remote.door.infer(request)) == await _outcome(channel.local.infer(request))
    values = _values(LARGE, 3)
    assert await _outcome(remote.door.infer(_echo(values, binary=False))) == await _outcome(
        channel.local.infer(_echo(values, binary=False))
    )


def _refused_requests() -> list[tuple[str, InferRequest]]:
    """Requests to `echo` and `simple` that the front door refuses by their checks."""
    too_few = _values(LARGE, 4)
    return [
        (
            "wrong datatype",
            InferRequest("echo", "", (InferInput("INPUT0", "INT32", (1, 4), np.zeros((1, 4), np.int32)),)),
        ),
        (
            "bytes that do not fill the shape",
            InferRequest(
                "echo", "", (InferInput("INPUT0", "FP32", (1, LARGE + 1), memoryview(too_few.tobytes())),), id="shape"
            ),
        ),
        ("a batch too large", _echo(_values(LARGE, 5).reshape(16, LARGE // 16))),
        (
            "a missing input",
            InferRequest("simple", "", (InferInput("INPUT0", "INT32", (1, 16), np.zeros((1, 16), np.int32)),)),
        ),
        (
            "a wrong shape after a good input",
            InferRequest(
                "simple",
                "",
                (
                    InferInput("INPUT0", "INT32", (1, 16), np.zeros((1, 16), np.int32)),
                    InferInput("INPUT1", "INT32", (1, 8), np.zeros((1, 8), np.int32)),
                ),
            ),
        ),
    ]


def _infer(request: InferRequest) -> Callable[[InferenceAPI], Awaitable[Any]]:
    return lambda api: api.infer(request)


def _bad_calls() -> list[tuple[str, Callable[[InferenceAPI], Awaitable[Any]]]]:
    calls = [(case, _infer(request)) for case, request in _refused_requests()]
    return [
        ("unknown model", lambda api: api.infer(_echo(_values(LARGE, 5), "bad", model="nope"))),
        ("unknown version", lambda api: api.infer(replace_version(_echo(_values(4, 5)), "7"))),
        *calls,
        ("decoupled model asked for one response", lambda api: api.infer(_repeat([1]))),
        ("metadata of an unknown version", lambda api: api.model_metadata("echo", "7")),
        ("config of an unknown model", lambda api: api.model_config("nope")),
        ("trace settings of an unknown model", lambda api: api.trace_settings("nope")),
        ("client shared memory not allowed", lambda api: api.register_shared_memory("r", "/x", 0, 16)),
        ("registering cuda memory", lambda api: api.register_cuda_shared_memory()),
        ("unknown log setting", lambda api: api.update_log_settings({"nope": 1})),
        ("loading a model that is not there", lambda api: api.load_model("nope", {})),
    ]


def replace_version(request: InferRequest, version: str) -> InferRequest:
    return InferRequest(request.model_name, version, request.inputs, request.outputs, request.id)


def replace_model(request: InferRequest, name: str) -> InferRequest:
    return InferRequest(name, request.model_version, request.inputs, request.outputs, request.id)


async def test_errors_arrive_as_the_same_error_and_the_next_request_is_served(remote: Remote, channel: Channel) -> None:
    for case, call in _bad_calls():
        local = await _outcome(call(channel.local))
        over_channel = await _outcome(call(remote.door))
        assert local[0] == "error", f"{case} is not an error in process"
        assert over_channel == local, case
        await _assert_good_request_served(remote)
    assert remote.link._calls == {} and remote.link._kept == {}


async def test_a_request_the_front_door_refuses_never_reaches_the_engine(remote: Remote, channel: Channel) -> None:
    refused = _refused_requests()
    failures_before = {name: await _failures(remote.door, name) for name in ("echo", "simple")}
    for case, request in refused:
        with pytest.raises(InvalidArgumentError):
            await remote.door.infer(request)
        assert channel.engine.submissions == [], case
    # Only the engine's statistics heard of them: each is a failed request of the version it addressed (told
    # without waiting for an answer, before the call that reads them).
    for name in ("echo", "simple"):
        count = sum(request.model_name == name for _, request in refused)
        assert await _failures(remote.door, name) == failures_before[name] + count
    # Inputs placed before a later check refused the request are let go with it.
    await _assert_inputs_freed(remote.arena)
    assert remote.link._calls == {} and remote.link._kept == {}
    await _assert_good_request_served(remote)
    assert [submission.model_name for submission in channel.engine.submissions] == ["echo"]


async def _failures(api: InferenceAPI, name: str) -> int:
    [entry] = await api.statistics(name, "1")
    count: int = entry["inference_stats"]["fail"]["count"]
    return count


async def test_only_interface_methods_can_be_called(remote: Remote, channel: Channel) -> None:
    methods = ("shutdown", "_service", "infer", "infer_stream", "stream_submission", "watch", "submit", "kill")
    for method in methods:
        with pytest.raises(InternalError, match=f"the engine has no call '{method}'"):
            await asyncio.wait_for(remote.link.call(method), HANG_GUARD_S)
    assert await channel.service.live() and await channel.service.model_ready("echo")
    await _assert_good_request_served(remote)


async def test_statistics_count_what_came_over_the_channel(remote: Remote, channel: Channel) -> None:
    for seed in range(3):
        await remote.door.infer(_echo(_values(LARGE, seed)))
    assert await remote.door.statistics("echo", "1") == await channel.local.statistics("echo", "1")
    [entry] = await remote.door.statistics("echo", "1")
    assert entry["inference_stats"]["success"]["count"] == 3
    assert await remote.door.statistics() == await channel.local.statistics()
    versions = await remote.door.version_statistics()
    assert repr(versions) == repr(await channel.local.version_statistics())  # quantiles may be NaN
    echo = next(snapshot for snapshot in versions if snapshot.name == "echo")
    assert isinstance(echo, VersionSnapshot) and echo.success.count == 3 and echo.histogram is not None


async def test_concurrent_infers_are_each_answered_with_their_own_values(remote: Remote, channel: Channel) -> None:
    # 200 of 24 KiB each: more than the arena holds at once, so some go to segments of their own instead.
    requests = [(index, _values(6000 + index % 7, index)) for index in range(200)]
    responses = await asyncio.wait_for(
        asyncio.gather(*(remote.door.infer(_echo(values, f"c{index}")) for index, values in requests)), HANG_GUARD_S
    )
    for (index, values), response in zip(requests, responses, strict=True):
        assert response.id == f"c{index}"
        np.testing.assert_array_equal(response.outputs[0].data, values)
    assert remote.link._calls == {} and remote.link._kept == {}
    kinds = [submission.inputs[0][1].where for submission in channel.engine.submissions]
    in_arena = sum(where is not None and where.kind == Kind.ARENA for where in kinds)
    if remote.arena is None:
        assert in_arena == 0
    else:
        assert 0 < in_arena < len(requests)  # the arena filled up: the others went to segments of their own
    assert len(channel.engine.submissions) == len(requests)
    del responses
    await _assert_inputs_freed(remote.arena)


# -- client shared memory --------------------------------------------------------------------


@pytest.fixture
async def shm_channel(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Channel]:
    """The channel's models, served with client shared memory allowed."""
    service = await _served(tmp_path, ServerSettings(allow_client_shm=True))
    async with _channel(service, tmp_path_factory.mktemp("channel")) as made:
        yield made


@pytest.mark.parametrize("arena", [False, True], ids=["segments", "arena"])
async def test_a_region_registered_through_the_engine_is_read_and_written_by_the_front_door(
    shm_channel: Channel, arena: bool
) -> None:
    channel = shm_channel
    remote = await channel.connect(arena=arena)
    key = f"remote-api-test-{secrets.token_hex(8)}"  # a client's: not of the server's reserved prefix
    values = _values(64, 10)
    (SHM_DIRECTORY / key).write_bytes(values.tobytes() + bytes(values.nbytes))
    try:
        await remote.door.register_shared_memory("region", "/" + key, 0, 2 * values.nbytes)
        status = await remote.door.shared_memory_status()
        assert status == await channel.local.shared_memory_status() and status[0]["name"] == "region"
        await _until(lambda: "region" in remote.link.regions._regions)  # the engine pushed its registry
        parameters: dict[str, str | int] = {"shared_memory_region": "region", "shared_memory_byte_size": values.nbytes}
        request = InferRequest(
            "echo",
            "",
            (InferInput("INPUT0", "FP32", values.shape, memoryview(b""), parameters),),
            (RequestedOutput("OUTPUT0", {**parameters, "shared_memory_offset": values.nbytes}),),
            id="in-region",
        )
        response = await remote.door.infer(request)
        [output] = response.outputs
        assert output.parameters["shared_memory_region"] == "region"
        written = np.frombuffer((SHM_DIRECTORY / key).read_bytes()[values.nbytes :], np.float32)
        np.testing.assert_array_equal(written, values.reshape(-1))
        [submission] = channel.engine.submissions
        where = submission.inputs[0][1].where
        assert where is not None and where.kind == Kind.CLIENT and where.segment == key  # read where it lies
        await remote.door.unregister_shared_memory("region")
        await _until(lambda: not remote.link.regions._regions)
        unregistered = await _outcome(remote.door.infer(request))
        assert unregistered[0] == "error" and unregistered == await _outcome(channel.local.infer(request))
        assert len(channel.engine.submissions) == 1
    finally:
        (SHM_DIRECTORY / key).unlink(missing_ok=True)


async def test_a_model_or_region_the_snapshots_lack_yet_is_asked_of_the_engine_before_a_request_is_refused(
    shm_channel: Channel,
) -> None:
    """Loaded or registered through another protocol process, whose client goes on at once: the pushed snapshot
    may still be on its way, so a name missing here is asked of the engine before the request is refused."""
    channel = shm_channel
    remote = await channel.connect()
    key = f"remote-api-test-{secrets.token_hex(8)}"
    values = _values(64, 11)
    (SHM_DIRECTORY / key).write_bytes(values.tobytes())
    try:
        await remote.door.register_shared_memory("region", "/" + key, 0, values.nbytes)
        await _until(lambda: "region" in remote.link.regions)
        # As the snapshots are before the engine's push arrives.
        remote.link._models = {name: model for name, model in remote.link.models.items() if name != "echo"}
        remote.link._regions.apply(())
        parameters: dict[str, str | int] = {"shared_memory_region": "region", "shared_memory_byte_size": values.nbytes}
        request = InferRequest(
            "echo", "", (InferInput("INPUT0", "FP32", values.shape, memoryview(b""), parameters),), id="fresh"
        )
        response = await remote.door.infer(request)
        np.testing.assert_array_equal(response.outputs[0].data, values)
        assert "echo" in remote.link.models and "region" in remote.link.regions
        # What the engine lacks too is refused as in process, after one look.
        unknown = _outcome(remote.door.infer(replace(request, model_name="nope")))
        assert await unknown == await _outcome(channel.local.infer(replace(request, model_name="nope")))
    finally:
        (SHM_DIRECTORY / key).unlink(missing_ok=True)


# -- model snapshots ------------------------------------------------------------------------


async def test_model_snapshots_pushed_to_the_front_door_follow_loads_and_unloads(
    channel: Channel, tmp_path: Path
) -> None:
    first = await channel.connect()
    second = await channel.connect(arena=True)
    for remote in (first, second):
        # Told on connecting, before any request is checked.
        assert remote.link.models == snapshot_of(channel.service.models)
        assert set(remote.link.models) == {"echo", GATED, "simple", "repeat_int32"}
    loaded = first.link.models["echo"].versions[1].load

    # Unloaded through one protocol process: every one hears of it, the caller before its call returns.
    await first.door.unload_model("echo")
    assert not first.link.models["echo"].versions
    await _until(lambda: not second.link.models["echo"].versions)
    for remote in (first, second):
        local = await _outcome(channel.local.infer(_echo(_values(4, 1))))
        assert local[0] == "error" and await _outcome(remote.door.infer(_echo(_values(4, 1)))) == local
    assert channel.engine.submissions == []  # refused where it was checked

    # Loaded again (through the engine itself): a new load, with a number of its own.
    await channel.service.load_model("echo", {})
    for remote in (first, second):
        await _until(functools.partial(_serves, remote, "echo"))
        assert remote.link.models == snapshot_of(channel.service.models)
        assert remote.link.models["echo"].versions[1].load > loaded
        await _assert_good_request_served(remote)
    assert [submission.load for submission in channel.engine.submissions] == [
        channel.service.models["echo"].versions[1].load
    ] * 2

    # A model new to the repository.
    write_identity_model(tmp_path, "late", dtype="TYPE_INT32", versions=(1, 2))
    await second.door.load_model("late", {})
    assert set(second.link.models["late"].versions) == {2}  # the default policy serves the latest version
    await _until(lambda: "late" in first.link.models)
    values = np.arange(5, dtype=np.int32).reshape(1, 5)
    request = InferRequest("late", "", (InferInput("INPUT0", "INT32", (1, 5), values),), id="late")
    response = await first.door.infer(request)
    assert response.model_version == "2"
    np.testing.assert_array_equal(response.outputs[0].data, values)


async def test_a_submission_checked_against_an_earlier_load_is_checked_again_in_the_engine(
    channel: Channel, tmp_path: Path
) -> None:
    # A reload can race a request: the front door checked it against the snapshot before the engine's push came.
    remote = await channel.connect()
    checked = remote.link.models["echo"].versions[1]
    values = _values(4, 30)

    def submission(request_id: str) -> Submission:
        tensor = Placement(None, RUN).place("FP32", values.shape, memoryview(values.tobytes()))
        return Submission("echo", "", 1, checked.load, (("INPUT0", tensor),), ("OUTPUT0",), {}, request_id)

    await remote.door.load_model("echo", {})  # reloaded as it was: the request still fits
    assert remote.link.models["echo"].versions[1].load != checked.load
    answer = await remote.link.infer(submission("same"))
    assert answer.outputs is not None and answer.model_version == "1"
    np.testing.assert_array_equal(answer.outputs["OUTPUT0"].array, values)
    del answer
    write_identity_model(tmp_path, "echo", dtype="TYPE_INT32")
    await remote.door.load_model("echo", {})  # now it takes INT32: the request checked against FP32 no longer fits
    failures = await _failures(remote.door, "echo")
    with pytest.raises(InvalidArgumentError, match="data-type is 'FP32', but model 'echo' expects 'INT32'"):
        await remote.link.infer(submission("changed"))
    assert await _failures(remote.door, "echo") == failures + 1
    assert remote.link._calls == {} and remote.link._kept == {}
    await _assert_inputs_freed(None)


def _serves(remote: Remote, name: str) -> bool:
    """Whether the front door's snapshot has a version of `name`."""
    model = remote.link.models.get(name)
    return model is not None and bool(model.versions)


# -- log settings --------------------------------------------------------------------------


async def test_log_settings_changes_reach_every_client(channel: Channel) -> None:
    heard: dict[str, list[tuple[str, Any]]] = {"first": [], "second": []}
    second_heard = asyncio.Event()

    def on_second(name: str, value: Any) -> None:
        heard["second"].append((name, value))
        second_heard.set()

    first = await channel.connect(on_event=lambda name, value: heard["first"].append((name, value)))
    await channel.connect(on_event=on_second, arena=True)
    assert heard == {"first": [], "second": []}  # the snapshots on connecting are the links' own
    try:
        changed = await first.door.update_log_settings({"log_verbose_level": 1})
        assert changed == await channel.service.log_settings() and changed["log_verbose_level"] == 1
        await asyncio.wait_for(second_heard.wait(), HANG_GUARD_S)
        assert heard["second"] == [(LOG_SETTINGS_EVENT, changed)]
        assert heard["first"] == [(LOG_SETTINGS_EVENT, changed)]  # the caller's own process too
        assert await first.door.log_settings() == changed
    finally:
        await channel.service.update_log_settings({"log_verbose_level": 0})
    await _assert_good_request_served(first)


async def test_a_call_that_fails_changes_no_log_settings_and_tells_no_one(channel: Channel) -> None:
    heard: list[tuple[str, Any]] = []
    client = await channel.connect(on_event=lambda name, value: heard.append((name, value)))
    before = await client.door.log_settings()
    with pytest.raises(InvalidArgumentError):
        await client.door.update_log_settings({"nope": 1})
    assert await client.door.log_settings() == before and heard == []


# -- cancellation and a lost engine --------------------------------------------------------


def _gated(values: np.ndarray) -> InferRequest:
    return _echo(values, model=GATED)


def _overwrite_free_blocks(arena: RequestArena) -> list[np.ndarray]:
    """Every free block of the arena, taken and overwritten."""
    taken = []
    while (block := arena.allocate(64 << 10)) is not None:
        block[:] = 0xFF
        taken.append(block)
    return taken


async def test_a_cancelled_call_is_cancelled_in_the_engine(remote: Remote, channel: Channel) -> None:
    engine, link = channel.engine, remote.link
    values = _values(LARGE, 6)
    waiting = asyncio.ensure_future(remote.door.infer(_gated(values)))
    await asyncio.wait_for(engine.entered.wait(), HANG_GUARD_S)
    assert len(link._kept) == 1 and len(link._calls) == 1
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await asyncio.wait_for(engine.cancelled.wait(), HANG_GUARD_S)  # the engine was told
    # Until the engine answers, the request's inputs stay where they are: a worker may still be reading them. Every
    # free block of the arena is overwritten now, and what the engine received is unchanged.
    gc.collect()
    assert len(link._kept) == 1 and link._calls == {}
    [(_, received)] = engine.submissions[-1].inputs
    assert received.where is not None
    fillers = _overwrite_free_blocks(remote.arena) if remote.arena is not None else []
    assert (remote.arena is None) == (not fillers)
    assert (SHM_DIRECTORY / received.where.segment).exists()
    np.testing.assert_array_equal(_array(received), values)
    fillers.clear()
    engine.release.set()
    await _until(lambda: not link._kept)
    assert link._calls == {}
    await _assert_good_request_served(remote)
    del waiting  # the cancelled call's traceback holds its frame, and the frame its inputs
    await _assert_inputs_freed(remote.arena)


async def test_an_answer_after_the_caller_gave_up_is_dropped(remote: Remote, channel: Channel) -> None:
    channel.engine.release.set()  # the engine gives up at once: its cancelled answer comes back
    waiting = asyncio.ensure_future(remote.door.infer(_gated(_values(4, 7))))
    await asyncio.wait_for(channel.engine.entered.wait(), HANG_GUARD_S)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await asyncio.wait_for(channel.engine.cancelled.wait(), HANG_GUARD_S)
    await _until(lambda: not remote.link._kept)  # its answer came, and went nowhere
    await _assert_good_request_served(remote)
    assert remote.link._calls == {} and remote.link._kept == {}


async def test_the_engine_answers_cancelled_when_its_call_is_cancelled_there(channel: Channel) -> None:
    # The engine's own cancellation (a connection that went away, or a cancel) is answered, not swallowed.
    client = await channel.connect()
    channel.engine.release.set()
    waiting = asyncio.ensure_future(client.door.infer(_gated(_values(4, 8))))
    await asyncio.wait_for(channel.engine.entered.wait(), HANG_GUARD_S)
    [cancel] = channel.connection()._submitted.values()
    cancel()
    with pytest.raises(CancelledError, match="the request was cancelled"):
        await asyncio.wait_for(waiting, HANG_GUARD_S)
    await _assert_good_request_served(client)
    assert client.link._calls == {} and client.link._kept == {}


async def test_a_closed_engine_fails_every_pending_and_later_call(remote: Remote, channel: Channel) -> None:
    channel.engine.release.set()
    pending = [asyncio.ensure_future(remote.door.infer(_gated(_values(LARGE, seed)))) for seed in range(3)]
    await asyncio.wait_for(channel.engine.entered.wait(), HANG_GUARD_S)
    stream = remote.door.infer_stream(_gated(_values(4, 12)))
    assert (await asyncio.wait_for(anext(stream), HANG_GUARD_S)).final is False  # a stream in flight, part read
    await _until(lambda: len(channel.engine.submissions) == 4)
    await channel.endpoint.stop()
    await asyncio.wait_for(remote.link.lost.wait(), HANG_GUARD_S)
    for call in pending:
        with pytest.raises(UnavailableError, match=ENGINE_GONE):
            await asyncio.wait_for(call, HANG_GUARD_S)
    assert remote.link._calls == {} and remote.link._kept == {}
    with pytest.raises(UnavailableError, match=ENGINE_GONE):
        async for _ in stream:
            pass
    with pytest.raises(UnavailableError, match=ENGINE_GONE):
        await remote.door.live()
    with pytest.raises(UnavailableError, match=ENGINE_GONE):
        await remote.door.infer(_echo(_values(LARGE, 9)))
    with pytest.raises(UnavailableError, match=ENGINE_GONE):
        await anext(remote.door.infer_stream(_repeat([1], delay_ms=0)))
    del pending, call
    await _assert_inputs_freed(remote.arena)


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


async def test_streams_answer_as_in_process(remote: Remote, channel: Channel) -> None:
    request = _repeat([4, 5, 6], request_id="s1")
    items = await asyncio.wait_for(_stream(remote.door, request), HANG_GUARD_S)
    assert items == await _stream(channel.local, request)
    assert isinstance(items, list) and [outputs for outputs, _, _ in items if outputs] == [
        (("OUT", [value]), ("IDX", [index])) for index, value in enumerate([4, 5, 6])
    ]
    assert items[-1][2] is True  # the final flag closes it
    assert remote.link._streams == {} and remote.link._kept == {}
    # A model that is not decoupled answers a stream with its one response, final.
    values = _values(LARGE, 11)
    one = await asyncio.wait_for(_stream(remote.door, _echo(values, "one")), HANG_GUARD_S)
    assert one == await _stream(channel.local, _echo(values, "one"))
    assert isinstance(one, list) and len(one) == 1 and one[0][2] is True


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
    remote: Remote, channel: Channel, request_of: Callable[[], InferRequest]
) -> None:
    over_channel = await asyncio.wait_for(_stream(remote.door, request_of()), HANG_GUARD_S)
    assert over_channel == await _stream(channel.local, request_of())
    good = await asyncio.wait_for(_stream(remote.door, _repeat([7])), HANG_GUARD_S)
    assert isinstance(good, list) and good[0][0] == (("OUT", [7]), ("IDX", [0]))
    assert remote.link._streams == {} and remote.link._kept == {}


def _generator(stream: AsyncIterator[StreamedResponse]) -> AsyncGenerator[StreamedResponse, None]:
    """A front door's stream, as the async generator it is: a front-end closes it when its client goes away."""
    assert isinstance(stream, AsyncGenerator)
    return stream


async def test_a_stream_left_early_is_cancelled_and_the_next_served(remote: Remote) -> None:
    stream = _generator(remote.door.infer_stream(_repeat(list(range(50)), delay_ms=1)))
    first = await asyncio.wait_for(anext(stream), HANG_GUARD_S)
    assert first.response is not None and first.response.outputs[0].data.tolist() == [0]
    await stream.aclose()  # the client went away
    await _until(lambda: not remote.link._streams and not remote.link._kept)
    items = await asyncio.wait_for(_stream(remote.door, _repeat([8, 9])), HANG_GUARD_S)
    assert isinstance(items, list) and [o for o, _, _ in items if o] == [
        (("OUT", [8]), ("IDX", [0])),
        (("OUT", [9]), ("IDX", [1])),
    ]


async def test_a_stream_left_early_is_cancelled_in_the_engine(remote: Remote, channel: Channel) -> None:
    stream = _generator(remote.door.infer_stream(_gated(_values(4, 12))))
    assert (await asyncio.wait_for(anext(stream), HANG_GUARD_S)).final is False
    await asyncio.wait_for(channel.engine.entered.wait(), HANG_GUARD_S)
    await stream.aclose()
    await asyncio.wait_for(channel.engine.cancelled.wait(), HANG_GUARD_S)
    await _until(lambda: not remote.link._kept and not remote.link._streams)
    await _assert_good_request_served(remote)


# -- outputs held until released ---------------------------------------------------------------


@pytest.fixture
async def process_channel(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Channel]:
    """`echo` on a worker process: its outputs lie in the worker's output arena, which the protocol process maps."""
    write_identity_model(tmp_path, "echo")
    settings = RepositorySettings(paths=(tmp_path,), control_mode=ControlMode.EXPLICIT, startup_models=("*",))
    pools = InstancePools(WorkerSettings(process_workers=True), run=RUN)
    service = InferenceService(ServerSettings(), settings, pools, metrics=MetricsSettings())
    pools.caller = service
    try:
        assert await service.load_models() == {}
    except BaseException:
        await service.shutdown()
        raise
    async with _channel(service, tmp_path_factory.mktemp("channel")) as made:
        yield made


def _held_outputs(channel: Channel) -> dict[int, SharedTensor]:
    """The engine's answers held for the protocol process: their one output, by lease."""
    return {lease: answer.outputs["OUTPUT0"] for lease, answer in channel.connection()._held.items() if answer.outputs}


async def test_an_answers_outputs_are_held_until_the_front_door_releases_them(process_channel: Channel) -> None:
    remote = await process_channel.connect(arena=True)
    first_values, second_values = _values(LARGE, 20), _values(LARGE, 21)
    first = await remote.door.infer(_echo(first_values, "first"))
    [(first_lease, held)] = _held_outputs(process_channel).items()
    assert held.where is not None and held.where.kind == Kind.ARENA  # where the worker wrote it
    first_where = held.where
    batch_lease = weakref.ref(held.lease)  # what keeps the worker from reusing the outputs' place
    del held
    # The response reads the worker's memory in place: while it lives the engine holds the answer, and the
    # worker writes the next one elsewhere.
    second = await remote.door.infer(_echo(second_values, "second"))
    held_now = _held_outputs(process_channel)
    assert set(held_now) == {first_lease, first_lease + 1}
    second_where = held_now[first_lease + 1].where
    del held_now
    assert second_where is not None and second_where.segment == first_where.segment
    assert second_where.offset != first_where.offset
    np.testing.assert_array_equal(first.outputs[0].data, first_values)
    np.testing.assert_array_equal(second.outputs[0].data, second_values)
    await asyncio.sleep(0.05)
    assert len(process_channel.connection()._held) == 2  # nothing released while read
    # Let go of one: released (RELEASE), and only that one.
    del second
    gc.collect()
    await _until(lambda: set(_held_outputs(process_channel)) == {first_lease})
    np.testing.assert_array_equal(first.outputs[0].data, first_values)
    assert batch_lease() is not None
    del first
    gc.collect()
    await _until(lambda: not process_channel.connection()._held)
    gc.collect()
    assert batch_lease() is None  # given back to the worker
    # The worker's memory is free again: the next answer is written where the first one was.
    third_values = _values(LARGE, 22)
    third = await remote.door.infer(_echo(third_values, "third"))
    [(_, third_held)] = _held_outputs(process_channel).items()
    assert third_held.where == first_where
    np.testing.assert_array_equal(third.outputs[0].data, third_values)
