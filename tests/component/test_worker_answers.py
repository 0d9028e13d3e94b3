"""The worker's end of its pipe: an answer too large for the channel reaches the front-end as errors, whole."""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest

from geserve.errors import InvalidArgumentError
from geserve.residency import Kind, Residency, SharedTensor
from geserve.workers import main as worker_main
from geserve.workers import messages, pipe
from geserve.workers.mailbox import Outbox
from geserve.workers.output_arena import OutputArena
from geserve.workers.runs import RunId
from geserve.workers.shm import SHM_DIRECTORY, create_segment, unlink_quietly

RUN = RunId.current()


def test_a_batch_answer_over_the_channel_limit_becomes_an_error_per_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pipe, "MAX_MESSAGE_BYTES", 1 << 14)
    front, worker = multiprocessing.Pipe(duplex=True)
    arena_name = RUN.segment_name("outputs")  # the worker's output arena, made by its owner
    create_segment(arena_name, 1 << 16).close()
    arena = OutputArena(arena_name)
    try:
        outbox = Outbox(worker, RUN)
        # The batch's outputs: one in a region of the arena, one too large for it in a one-off segment of its own.
        small = np.arange(64, dtype=np.float32).reshape(2, 32)
        offset = arena.allocate(3, small.nbytes)
        assert offset is not None
        np.ndarray(small.shape, small.dtype, buffer=arena.mapping, offset=offset)[...] = small
        one_off = RUN.segment_name("out")
        large_bytes = 2 * 4096 * 4
        arena.one_off(3, one_off, large_bytes)
        assert (SHM_DIRECTORY / one_off).exists()
        other = arena.allocate(2, 256)  # another batch's outputs, still being read
        assert other is not None and arena.held == 2
        blocks = (
            ("SMALL", SharedTensor("FP32", small.shape, Residency(Kind.ARENA, arena_name, offset, small.nbytes))),
            ("LARGE", SharedTensor("FP32", (2, 4096), Residency(Kind.ONE_OFF, one_off, 0, large_bytes))),
        )
        huge = {"note": "n" * (1 << 15)}  # the model's response parameters
        results = (((0, 0, 1), (1, 0, 1)), ((0, 1, 1), (1, 1, 1)))
        placed = messages.BatchPlaced(3, blocks, results, 10, 20, (huge, huge))
        with pytest.raises(InvalidArgumentError, match="exceeds the worker channel's limit of 16384 bytes") as raised:
            outbox.send(placed)
        assert not front.poll(0)  # nothing of it was written
        worker_main._refuse(outbox, placed, raised.value, arena)
        answer = front.recv()
        assert isinstance(answer, messages.BatchPlaced)
        assert (answer.batch_id, answer.blocks, answer.infer_start_ns, answer.infer_end_ns) == (3, (), 10, 20)
        assert [str(error) for error in answer.results] == [str(raised.value)] * 2
        # Nobody will read its outputs, so nobody will release them: they are released at once.
        assert not (SHM_DIRECTORY / one_off).exists()
        assert arena.held == 1  # the other batch's outputs are untouched
        arena.release((2,))
        assert arena.allocate(4, arena.size) == 0  # every region of the arena is free again
    finally:
        arena.release_all()
        arena.mapping.close()
        unlink_quietly(arena_name)
        front.close()
        worker.close()
