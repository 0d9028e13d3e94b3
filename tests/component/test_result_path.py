"""The one result path: a worker places a batch's outputs in shared memory, the front-end reads each request's own."""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import Iterator

import numpy as np
import pytest

from geserve.backends.base import RequestResult
from geserve.errors import GeserveError, InternalError
from geserve.workers.arenas import Arenas
from geserve.workers.handoff import MappedOutputs
from geserve.workers.main import _ShmBatchRunner
from geserve.workers.messages import BatchPlaced, InstanceSpec, RequestInfo, RunBatch
from geserve.workers.output_blocks import OutputBlocks
from geserve.workers.runs import RunId
from geserve.workers.shm import InPlaceOutputs, buffer_of


@pytest.fixture
def arenas() -> Iterator[Arenas]:
    created = Arenas(1, 1 << 16, RunId.current(), MappedOutputs())
    created.create()
    yield created
    created.unlink()


def round_trip(
    arenas: Arenas,
    requests: tuple[RequestInfo, ...],
    results: tuple[RequestResult, ...],
    whole: dict[str, np.ndarray] | None = None,
    in_place: dict[str, np.ndarray] | None = None,
) -> tuple[tuple[RequestResult, ...], BatchPlaced]:
    """What the worker answers (through a pickle, as over the pipe), read back as the front-end reads it."""
    _, output_arena = arenas.names
    batches = _ShmBatchRunner(InstanceSpec("m", 1, "m_0", "identity", b"", "", 0, False, 30, arenas=arenas.names))
    message = RunBatch(7, (), ("A", "B"), output_arena, f"{output_arena}_overflow", requests)
    arena_outputs = InPlaceOutputs(buffer_of(batches.arenas[output_arena]), output_arena)
    outputs = dict(whole or {})
    for name, array in (in_place or {}).items():  # as a backend that writes its outputs where it is told
        target = arena_outputs.allocate(name, "FP32", array.shape)
        target[...] = array
        outputs[name] = target
    blocks = OutputBlocks({"A": "FP32", "B": "FP32", "S": "BYTES"}, arena_outputs)
    placed = blocks.place(results, outputs, message.requests)
    blocks.written(batches._write(blocks.layout, output_arena, message.output_overflow, arena_outputs.end))
    answer = pickle.loads(pickle.dumps(BatchPlaced(7, blocks.refs(), placed, 1, 2)))
    del outputs, arena_outputs
    collected = asyncio.run(arenas.collect(answer.blocks, answer.results))
    for segment in batches.arenas.values():
        segment.close()
    return collected, answer


def test_a_batch_output_is_one_block_and_each_request_gets_its_rows(arenas: Arenas) -> None:
    a = np.arange(4 * 3, dtype=np.float32).reshape(4, 3)
    b = -a
    requests = (RequestInfo(1, ("A", "B")), RequestInfo(2, ("A",)), RequestInfo(1, ("B", "A")))
    collected, answer = round_trip(arenas, requests, ({}, {}, {}), whole={"A": a, "B": b})
    assert len(answer.blocks) == 2  # one per output, not one per request
    first, second, third = collected
    assert isinstance(first, dict) and isinstance(second, dict) and isinstance(third, dict)
    np.testing.assert_array_equal(first["A"], a[0:1])
    np.testing.assert_array_equal(first["B"], b[0:1])
    assert list(second) == ["A"]
    np.testing.assert_array_equal(second["A"], a[1:3])
    assert list(third) == ["B", "A"]
    np.testing.assert_array_equal(third["B"], b[3:4])
    np.testing.assert_array_equal(third["A"], a[3:4])


def test_outputs_written_in_place_are_referred_to_where_they_lie(arenas: Arenas) -> None:
    a = np.arange(3 * 2, dtype=np.float32).reshape(3, 2)
    requests = (RequestInfo(2, ("A",)), RequestInfo(1, ("A",)))
    collected, answer = round_trip(arenas, requests, ({}, {}), whole={}, in_place={"A": a})
    assert answer.blocks[0].offset == 0 and answer.blocks[0].shape == (3, 2)
    np.testing.assert_array_equal(collected[0]["A"], a[0:2])  # type: ignore[index]
    np.testing.assert_array_equal(collected[1]["A"], a[2:3])  # type: ignore[index]


def test_a_single_request_gets_the_whole_output_even_without_a_batch_dimension(arenas: Arenas) -> None:
    scalar = np.array(5.0, dtype=np.float32)
    (result,), _ = round_trip(arenas, (RequestInfo(1, ("A",)),), ({},), whole={"A": scalar})
    assert isinstance(result, dict) and result["A"].shape == () and result["A"] == 5.0


def test_per_request_outputs_are_stacked_when_they_agree_and_kept_apart_when_not(arenas: Arenas) -> None:
    strings = np.array([b"x", b"yz"], dtype=np.object_)
    results: tuple[RequestResult, ...] = (
        {"A": np.ones((2, 3), np.float32), "S": strings},
        InternalError("request 1 failed on its own"),
        {"A": np.zeros((1, 3), np.float32), "B": np.arange(5, dtype=np.float32)},
        {"B": np.arange(2, dtype=np.float32).reshape(2, 1)},  # ragged against the other B
    )
    requests = tuple(RequestInfo(1, ()) for _ in results)
    collected, answer = round_trip(arenas, requests, results)
    assert [block.name for block in answer.blocks].count("A") == 1  # the two A outputs share one block
    first, failed, third, fourth = collected
    assert isinstance(failed, GeserveError) and failed.message == "request 1 failed on its own"
    assert isinstance(first, dict) and isinstance(third, dict) and isinstance(fourth, dict)
    np.testing.assert_array_equal(first["A"], np.ones((2, 3), np.float32))
    assert first["S"].tolist() == [b"x", b"yz"]
    np.testing.assert_array_equal(third["A"], np.zeros((1, 3), np.float32))
    np.testing.assert_array_equal(third["B"], np.arange(5, dtype=np.float32))
    np.testing.assert_array_equal(fourth["B"], np.arange(2, dtype=np.float32).reshape(2, 1))


def test_the_results_are_copies_the_next_batch_cannot_overwrite(arenas: Arenas) -> None:
    a = np.arange(4, dtype=np.float32).reshape(2, 2)
    collected, _ = round_trip(arenas, (RequestInfo(1, ("A",)), RequestInfo(1, ("A",))), ({}, {}), whole={"A": a})
    round_trip(arenas, (RequestInfo(2, ("A",)),), ({},), whole={"A": a + 100})
    np.testing.assert_array_equal(collected[0]["A"], a[0:1])  # type: ignore[index]
    np.testing.assert_array_equal(collected[1]["A"], a[1:2])  # type: ignore[index]
