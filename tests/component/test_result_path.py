"""The result path: a worker holds a batch's outputs in shared memory until released; readers view their own rows."""

from __future__ import annotations

import asyncio
import gc
import itertools
import multiprocessing
import pickle
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Protocol

import numpy as np
import pytest

from geserve._generated import model_config_pb2 as mc
from geserve.backends import registry
from geserve.backends.base import (
    Backend,
    BackendRequest,
    Capabilities,
    OutputAllocator,
    RequestBackend,
    RequestResult,
    ResponseEmitter,
)
from geserve.errors import GeserveError, InternalError
from geserve.residency import MAPPINGS, SHM_DIRECTORY, Kind, Lease, Residency, SharedTensor
from geserve.workers import main as worker_main
from geserve.workers.arenas import Arenas, ArenaSlot
from geserve.workers.mailbox import Inbox, Outbox
from geserve.workers.messages import (
    BatchPlaced,
    InstanceSpec,
    Release,
    RequestInfo,
    RunBatch,
    TensorResult,
    request_outputs,
)
from geserve.workers.runner import InstanceRunner
from geserve.workers.runs import RunId

RUN = RunId.current()
ARENA_BYTES = 1 << 16  # each worker's input arena (one slot) and output arena


def _config(*tensors: tuple[str, str, mc.DataType.ValueType]) -> mc.ModelConfig:
    """A batching model: (input, output, data type) for each pair the identity backend copies."""
    config = mc.ModelConfig(name="m", max_batch_size=8)
    for source, output, datatype in tensors:
        config.input.append(mc.ModelInput(name=source, data_type=datatype, dims=[-1]))
        config.output.append(mc.ModelOutput(name=output, data_type=datatype, dims=[-1]))
    return config


# X -> A, Y -> B, S -> T (strings).
IDENTITY = _config(("X", "A", mc.TYPE_FP32), ("Y", "B", mc.TYPE_FP32), ("S", "T", mc.TYPE_STRING))
# Outputs the per-request backend answers with: A, B and the strings S.
OWN = _config(("X", "A", mc.TYPE_FP32), ("Y", "B", mc.TYPE_FP32), ("Z", "S", mc.TYPE_STRING))


class WritesInPlace:
    """X -> A copied where the worker tells it, as a device backend copies its outputs out; it keeps the arrays it
    was given (to write to afterwards), and with `fail` fails once it has copied them."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.given: list[np.ndarray] = []

    def load(self, config: mc.ModelConfig, model_path: Path, device_id: int) -> None:
        pass

    def complete_config(self, config: mc.ModelConfig, auto_complete: bool) -> None:
        pass

    def execute(
        self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str], allocate: OutputAllocator | None = None
    ) -> dict[str, np.ndarray]:
        assert allocate is not None, "the worker offers its output arena"
        outputs: dict[str, np.ndarray] = {}
        for name in output_names:
            target = allocate(name, "FP32", tuple(inputs["X"].shape))
            target[...] = inputs["X"]
            self.given.append(target)
            outputs[name] = target
        if self.fail:
            raise InternalError("the device failed after its outputs were copied out")
        return outputs

    def unload(self) -> None:
        self.given.clear()


class Answers:
    """Answers each request of a batch with its own result (as a python model does), given in advance."""

    def __init__(self, results: Sequence[RequestResult]) -> None:
        self._results = list(results)

    def load(self, config: mc.ModelConfig, model_path: Path, device_id: int) -> None:
        pass

    def complete_config(self, config: mc.ModelConfig, auto_complete: bool) -> None:
        pass

    def execute(
        self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str], allocate: OutputAllocator | None = None
    ) -> dict[str, np.ndarray]:
        raise AssertionError("a per-request backend is given its requests")

    def execute_requests(self, requests: Sequence[BackendRequest], emit: ResponseEmitter) -> list[RequestResult]:
        assert len(requests) == len(self._results)
        return self._results

    def unload(self) -> None:
        pass


@dataclass(frozen=True)
class _Given:
    """A registry entry handing out a backend the test made."""

    made: Capabilities

    def create_typed(self) -> Capabilities:
        return self.made


class Answer(NamedTuple):
    """A batch's answer as the front-end has it: where each output block lies, and each request's result."""

    blocks: tuple[tuple[str, Residency | None], ...]
    results: tuple[TensorResult, ...]


class Worker:
    """One instance's batch path with both ends in this process: its owner's arenas and the worker's runner and
    output arena (the real ones), the message through a pickle, the answer and Release through the worker's pipe."""

    def __init__(self, backend: str, config: mc.ModelConfig) -> None:
        self.arenas = Arenas(1, ARENA_BYTES, RUN)
        self.arenas.create()
        self.segments = {*self.arenas.names, self.arenas.output_name}
        spec = InstanceSpec(
            model_name="m",
            model_version=1,
            instance_name="m_0",
            backend=backend,
            config=config.SerializeToString(),
            model_path="",
            device_id=0,
            auto_complete=False,
            log_level=30,
            arenas=self.arenas.names,
            output_arena=self.arenas.output_name,
            run=RUN,
        )
        self.runner = InstanceRunner(spec)
        try:
            self.runner.load()
        except BaseException:
            self.arenas.unlink()
            raise
        self.batches = worker_main._ShmBatchRunner(spec)
        self._front, self._end = multiprocessing.Pipe()
        self._outbox = Outbox(self._end, RUN)
        self._inbox = Inbox(self._end, self.runner.cancelled, self._outbox, False, release=self.batches.outputs.release)
        self._ids = itertools.count(1)
        self._slot: ArenaSlot | None = None
        self._done: list[int] = []  # batches whose readers let go, not told to the worker yet

    @property
    def output_arena(self) -> str:
        return self.arenas.output_name

    @property
    def held(self) -> int:
        """Batches whose outputs the worker still holds."""
        return self.batches.outputs.held

    def send(self, inputs: Mapping[str, Sequence[SharedTensor]], requests: tuple[RequestInfo, ...]) -> RunBatch:
        """The batch as the worker receives it: its inputs placed by the owner, the message through a pickle."""
        assert self._slot is None
        self._slot, placed = asyncio.run(self.arenas.place(inputs))
        output_names = tuple(dict.fromkeys(name for info in requests for name in info.output_names))
        message = RunBatch(next(self._ids), placed, output_names, requests)
        received = pickle.loads(pickle.dumps(message))
        assert isinstance(received, RunBatch)
        return received

    def stage(self, message: RunBatch) -> worker_main._Running:
        running = self.batches.stage(self.runner, message)
        self.runner.launch(running.batch)
        return running

    def answer(self, running: worker_main._Running) -> Answer:
        """Finish the batch as the worker's loop does and read its answer as the front-end does: each request's
        outputs held by a lease whose end is a Release for `let_go` to send."""
        assert worker_main._answer(self.batches, self.runner, self._outbox, running, None)
        placed = self._front.recv()
        assert isinstance(placed, BatchPlaced) and placed.batch_id == running.message.batch_id
        assert self._slot is not None
        self.arenas.release(self._slot)
        self._slot = None
        blocks = tuple((name, tensor.where) for name, tensor in placed.blocks)
        self.segments.update(where.segment for _, where in blocks if where is not None)
        lease = Lease(placed.batch_id, self._ended) if placed.blocks else None
        return Answer(blocks, request_outputs(placed.blocks, placed.results, lease))

    def run(self, inputs: Mapping[str, Sequence[SharedTensor]], requests: tuple[RequestInfo, ...]) -> Answer:
        return self.answer(self.stage(self.send(inputs, requests)))

    def _ended(self, batch_id: object) -> None:
        """A batch's lease ended (on whatever thread let go of it last), as the channel hears it."""
        assert isinstance(batch_id, int)
        self._done.append(batch_id)

    def let_go(self) -> tuple[int, ...]:
        """Send the worker a Release for the batches whose last reader let go, as the channel does, and have its
        inbox take it; the batch ids released."""
        gc.collect()
        done, self._done = tuple(self._done), []
        if done:
            self._front.send(Release(done))
            assert self._inbox.get() is None  # handled there, nothing for the loop
        return done

    def close(self) -> None:
        if self._slot is not None:
            self.arenas.release(self._slot)
        self.runner.unload()
        self.batches.outputs.release_all()
        self.arenas.unlink()
        self._inbox.close()
        self._front.close()
        self._end.close()
        for name in MAPPINGS.names():  # its arenas, and one-off segments their owners removed
            if name in self.segments or not (SHM_DIRECTORY / name).exists():
                MAPPINGS.forget(name)


class WorkerFactory(Protocol):
    def __call__(self, backend: Backend | None = None, config: mc.ModelConfig = IDENTITY) -> Worker: ...


@pytest.fixture
def workers(monkeypatch: pytest.MonkeyPatch) -> Iterator[WorkerFactory]:
    """Make workers of the identity backend, or of a backend object given; each is closed (its segments unlinked)."""
    made: list[Worker] = []
    real = registry.by_name

    def make(backend: Backend | None = None, config: mc.ModelConfig = IDENTITY) -> Worker:
        if backend is not None:
            per_request: RequestBackend | None = backend if isinstance(backend, Answers) else None
            given = _Given(Capabilities(backend, per_request=per_request))
            monkeypatch.setattr(registry, "by_name", lambda name: given if name == "given" else real(name))
        worker = Worker("identity" if backend is None else "given", config)
        made.append(worker)
        return worker

    yield make
    for worker in made:
        worker.close()
    gc.collect()


def local(**arrays: np.ndarray) -> dict[str, list[SharedTensor]]:
    """Each input as one part held in this process (written to the input arena when placed)."""
    return {name: [SharedTensor.local(array)] for name, array in arrays.items()}


def rows(array: np.ndarray, *counts: int) -> list[SharedTensor]:
    """An input as its requests' row blocks, each held in this process."""
    parts: list[SharedTensor] = []
    first = 0
    for count in counts:
        parts.append(SharedTensor.local(array[first : first + count]))
        first += count
    return parts


def outputs(result: TensorResult) -> dict[str, SharedTensor]:
    assert isinstance(result, dict), result
    return result


def _where(tensor: SharedTensor) -> Residency:
    assert tensor.where is not None
    return tensor.where


# -- each request's own rows ---------------------------------------------------------------------------


def test_a_batch_output_is_one_block_and_each_request_gets_its_rows_where_they_lie(workers: WorkerFactory) -> None:
    worker = workers()
    a = np.arange(4 * 3, dtype=np.float32).reshape(4, 3)
    requests = (RequestInfo(1, ("A", "B")), RequestInfo(2, ("A",)), RequestInfo(1, ("B", "A")))
    answer = worker.run({"X": rows(a, 1, 2, 1), "Y": rows(-a, 1, 2, 1)}, requests)
    assert [name for name, _ in answer.blocks] == ["A", "B"]  # one per output, not one per request
    for _, where in answer.blocks:
        assert where is not None and (where.kind, where.segment) == (Kind.ARENA, worker.output_arena)
    first, second, third = map(outputs, answer.results)
    np.testing.assert_array_equal(first["A"].array, a[0:1])
    np.testing.assert_array_equal(first["B"].array, -a[0:1])
    assert list(second) == ["A"]
    np.testing.assert_array_equal(second["A"].array, a[1:3])
    assert list(third) == ["B", "A"]
    np.testing.assert_array_equal(third["B"].array, -a[3:4])
    np.testing.assert_array_equal(third["A"].array, a[3:4])
    # A request's rows are an offset into the block, not a copy of them.
    block_a = answer.blocks[0][1]
    assert block_a is not None
    assert _where(second["A"]) == block_a._replace(offset=block_a.offset + 3 * 4, nbytes=2 * 3 * 4)


def test_outputs_written_in_place_are_referred_to_where_they_lie(workers: WorkerFactory) -> None:
    backend = WritesInPlace()
    worker = workers(backend)
    a = np.arange(3 * 2, dtype=np.float32).reshape(3, 2)
    answer = worker.run({"X": rows(a, 2, 1)}, (RequestInfo(2, ("A",)), RequestInfo(1, ("A",))))
    # The region the backend was given first (at the start of the arena), not a copy laid out after it.
    assert answer.blocks == (("A", Residency(Kind.ARENA, worker.output_arena, 0, a.nbytes)),)
    first, second = map(outputs, answer.results)
    view = first["A"].array
    np.testing.assert_array_equal(view, a[0:2])
    np.testing.assert_array_equal(second["A"].array, a[2:3])
    (given,) = backend.given
    given[0, 0] = 42.0  # the worker's array and the reader's view are the same bytes
    assert view[0, 0] == 42.0


def test_a_single_request_gets_the_whole_output_even_without_a_batch_dimension(workers: WorkerFactory) -> None:
    worker = workers()
    answer = worker.run(local(X=np.array(5.0, dtype=np.float32)), (RequestInfo(1, ("A",)),))
    (result,) = answer.results
    tensor = outputs(result)["A"]
    assert tensor.shape == () and tensor.array.shape == () and tensor.array == 5.0


def test_per_request_outputs_are_stacked_when_they_agree_and_kept_apart_when_not(workers: WorkerFactory) -> None:
    strings = np.array([b"x", b"yz"], dtype=np.object_)
    results: tuple[RequestResult, ...] = (
        {"A": np.ones((2, 3), np.float32), "S": strings},
        InternalError("request 1 failed on its own"),
        {"A": np.zeros((1, 3), np.float32), "B": np.arange(5, dtype=np.float32)},
        {"B": np.arange(2, dtype=np.float32).reshape(2, 1)},  # ragged against the other B
    )
    worker = workers(Answers(results), OWN)
    x = np.zeros((5, 3), np.float32)
    answer = worker.run({"X": rows(x, 2, 1, 1, 1)}, tuple(RequestInfo(n, ()) for n in (2, 1, 1, 1)))
    names = [name for name, _ in answer.blocks]
    assert names.count("A") == 1 and names.count("B") == 2 and names.count("S") == 1  # the two As share one block
    failed = answer.results[1]
    assert isinstance(failed, GeserveError) and failed.message == "request 1 failed on its own"
    first, third, fourth = (outputs(answer.results[index]) for index in (0, 2, 3))
    np.testing.assert_array_equal(first["A"].array, np.ones((2, 3), np.float32))
    assert first["S"].array.tolist() == [b"x", b"yz"]
    np.testing.assert_array_equal(third["A"].array, np.zeros((1, 3), np.float32))
    np.testing.assert_array_equal(third["B"].array, np.arange(5, dtype=np.float32))
    np.testing.assert_array_equal(fourth["B"].array, np.arange(2, dtype=np.float32).reshape(2, 1))
    assert _where(first["A"]).segment == _where(third["A"]).segment == worker.output_arena


def test_a_bytes_output_is_split_into_each_requests_own_block(workers: WorkerFactory) -> None:
    worker = workers()
    strings = np.array([[b"a"], [b"bc"], [b""], [b"def"]], dtype=np.object_)
    a = np.arange(4, dtype=np.float32).reshape(4, 1)
    requests = (RequestInfo(1, ("T", "A")), RequestInfo(3, ("T",)))
    answer = worker.run({"S": rows(strings, 1, 3), "X": rows(a, 1, 3)}, requests)
    names = [name for name, _ in answer.blocks]
    assert names.count("T") == 2 and names.count("A") == 1  # a BYTES row's size varies: each request's own
    first, second = map(outputs, answer.results)
    assert first["T"].array.tolist() == [[b"a"]]
    assert second["T"].array.tolist() == [[b"bc"], [b""], [b"def"]]
    np.testing.assert_array_equal(first["A"].array, a[0:1])
    assert _where(first["T"]).segment == _where(second["T"]).segment == worker.output_arena


# -- held until released -------------------------------------------------------------------------------


def test_results_are_not_overwritten_by_the_next_batch_until_released(workers: WorkerFactory) -> None:
    worker = workers()
    a = np.arange(4, dtype=np.float32).reshape(2, 2)
    answer = worker.run({"X": rows(a, 1, 1)}, (RequestInfo(1, ("A",)), RequestInfo(1, ("A",))))
    views = [outputs(result)["A"].array for result in answer.results]
    del answer
    assert worker.let_go() == ()  # the views still read the batch's outputs: they hold its lease
    for batch_id in (2, 3):  # later batches, each released at once, take other regions of the arena
        worker.run({"X": rows(a + 100 * batch_id, 1, 1)}, (RequestInfo(1, ("A",)), RequestInfo(1, ("A",))))
        assert worker.let_go() == (batch_id,)
    np.testing.assert_array_equal(views[0], a[0:1])
    np.testing.assert_array_equal(views[1], a[1:2])
    del views
    assert worker.let_go() == (1,) and worker.held == 0


def test_a_region_is_not_reused_before_its_release_and_is_after(workers: WorkerFactory) -> None:
    worker = workers()
    a = np.arange(6, dtype=np.float32).reshape(2, 3)

    def offset_of(answer: Answer) -> int:
        ((_, where),) = answer.blocks
        assert where is not None and where.kind == Kind.ARENA
        return where.offset

    first = worker.run(local(X=a), (RequestInfo(2, ("A",)),))
    second = worker.run(local(X=a + 1), (RequestInfo(2, ("A",)),))
    assert offset_of(second) != offset_of(first) and worker.held == 2
    freed = offset_of(first)
    del first
    assert worker.let_go() == (1,) and worker.held == 1
    third = worker.run(local(X=a + 2), (RequestInfo(2, ("A",)),))
    assert offset_of(third) == freed  # first fit: the released region again
    np.testing.assert_array_equal(outputs(third.results[0])["A"].array, a + 2)
    np.testing.assert_array_equal(outputs(second.results[0])["A"].array, a + 1)
    del second, third
    assert sorted(worker.let_go()) == [2, 3] and worker.held == 0


def test_outputs_that_do_not_fit_go_to_a_one_off_segment_unlinked_when_released(workers: WorkerFactory) -> None:
    worker = workers()
    big = np.arange(ARENA_BYTES * 5 // 8 // 4, dtype=np.float32).reshape(2, -1)  # 5/8 of the arena
    kept = worker.run(local(X=big), (RequestInfo(2, ("A",)),))
    ((_, in_arena),) = kept.blocks
    assert in_arena is not None and in_arena.kind == Kind.ARENA
    over = worker.run(local(X=big + 1), (RequestInfo(2, ("A",)),))  # the arena holds the first one still
    ((_, where),) = over.blocks
    assert where is not None and where.kind == Kind.ONE_OFF and where.segment.startswith(RUN.prefix)
    assert (SHM_DIRECTORY / where.segment).exists()
    np.testing.assert_array_equal(outputs(over.results[0])["A"].array, big + 1)
    del over
    assert worker.let_go() == (2,)
    assert not (SHM_DIRECTORY / where.segment).exists()
    np.testing.assert_array_equal(outputs(kept.results[0])["A"].array, big)  # the arena's region is still held
    assert worker.held == 1


def test_a_failed_batch_does_not_hold_the_regions_its_backend_was_given(workers: WorkerFactory) -> None:
    worker = workers(WritesInPlace(fail=True))
    answer = worker.run(local(X=np.ones((2, 2), np.float32)), (RequestInfo(2, ("A",)),))
    assert answer.blocks == () and isinstance(answer.results[0], InternalError)
    worker.let_go()
    assert worker.held == 0


def test_a_released_one_off_segment_is_no_longer_mapped_by_its_reader(workers: WorkerFactory) -> None:
    worker = workers()
    big = np.arange(ARENA_BYTES * 5 // 4 // 4, dtype=np.float32).reshape(2, -1)  # more than the whole arena
    over = worker.run(local(X=big), (RequestInfo(2, ("A",)),))
    ((_, where),) = over.blocks
    assert where is not None and where.kind == Kind.ONE_OFF
    np.testing.assert_array_equal(outputs(over.results[0])["A"].array, big)
    del over
    assert worker.let_go() == (1,) and not (SHM_DIRECTORY / where.segment).exists()
    assert where.segment not in Path("/proc/self/maps").read_text()


# -- descriptors ---------------------------------------------------------------------------------------


def test_a_shared_tensor_pickles_as_its_descriptor_and_reads_the_same_values_in_another_mapping(
    workers: WorkerFactory,
) -> None:
    backend = WritesInPlace()
    worker = workers(backend)
    a = np.arange(2 * 1024, dtype=np.float32).reshape(2, 1024)
    answer = worker.run(local(X=a), (RequestInfo(1, ("A",)), RequestInfo(1, ("A",))))
    second = outputs(answer.results[1])["A"]
    data = pickle.dumps(second)
    assert len(data) < 300 < second.nbytes  # where it lies, not its 4 KiB
    MAPPINGS.forget(worker.output_arena)  # read as a process that never mapped it
    copy = pickle.loads(data)
    assert isinstance(copy, SharedTensor) and copy.lease is None
    assert (copy.datatype, copy.shape, copy.where) == ("FP32", (1, 1024), second.where)
    assert worker.output_arena not in MAPPINGS.names()  # nothing is mapped until its bytes are asked for
    np.testing.assert_array_equal(copy.array, a[1:2])
    assert worker.output_arena in MAPPINGS.names()
    (given,) = backend.given  # the worker's own mapping of its arena
    given[1, 7] = -1.0
    assert copy.array[0, 7] == -1.0  # the same bytes, not a copy taken when mapped


def test_a_workers_output_is_the_next_steps_input_by_reference(workers: WorkerFactory) -> None:
    first, then = workers(), workers()
    a = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    (result,) = first.run(local(X=a), (RequestInfo(64, ("A",)),)).results
    handed = outputs(result)["A"]
    fresh = np.full((64, 1), 7.0, np.float32)
    message = then.send({"X": [handed], "Y": [SharedTensor.local(fresh)]}, (RequestInfo(64, ("A", "B")),))
    by_name = {name: parts for name, _, parts in message.inputs}
    (passed,) = by_name["X"]
    assert passed.where == handed.where  # where the first worker left it, not written to this worker's arena
    (written,) = by_name["Y"]
    assert written.where is not None and written.where.segment in then.arenas.names  # held here: written once
    assert len(pickle.dumps(message)) < 1024 < a.nbytes
    running = then.stage(message)
    np.testing.assert_array_equal(running.batch.inputs["X"], a)
    assert np.shares_memory(running.batch.inputs["X"], handed.array)  # read in place, through the same mapping
    a_out, b_out = outputs(then.answer(running).results[0]).values()
    np.testing.assert_array_equal(a_out.array, a)
    np.testing.assert_array_equal(b_out.array, fresh)
    assert _where(a_out).segment == then.output_arena
    del result, handed, passed, running
    assert first.let_go() == (1,) and first.held == 0
