"""The worker's end of its pipe: an answer too large for the channel reaches the front-end as errors, whole."""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest

from geserve.errors import InvalidArgumentError
from geserve.workers import main as worker_main
from geserve.workers import messages, pipe
from geserve.workers.mailbox import Outbox
from geserve.workers.runs import RunId
from geserve.workers.shm import SHM_DIRECTORY, write_tensors

RUN = RunId.current()


def test_a_batch_answer_over_the_channel_limit_becomes_an_error_per_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pipe, "MAX_MESSAGE_BYTES", 1 << 14)
    front, worker = multiprocessing.Pipe(duplex=True)
    try:
        outbox = Outbox(worker, RUN)
        overflow = RUN.segment_name("overflow")
        refs = write_tensors({"OUT": np.arange(4096, dtype=np.float32)}, overflow)
        assert refs[0].segment == overflow and (SHM_DIRECTORY / overflow).exists()
        message = messages.RunBatch(3, (), ("OUT",), "arena", overflow, ())
        huge = {"note": "n" * (1 << 15)}  # the model's response parameters
        placed = messages.BatchPlaced(3, refs, (((0, 0, 1),), ((0, 1, 1),)), 10, 20, (huge, huge))
        with pytest.raises(InvalidArgumentError, match="exceeds the worker channel's limit of 16384 bytes") as raised:
            outbox.send(placed)
        assert not front.poll(0)  # nothing of it was written
        worker_main._refuse(outbox, placed, message, raised.value)
        answer = front.recv()
        assert isinstance(answer, messages.BatchPlaced)
        assert (answer.batch_id, answer.blocks, answer.infer_start_ns, answer.infer_end_ns) == (3, (), 10, 20)
        assert [str(error) for error in answer.results] == [str(raised.value)] * 2
        assert not (SHM_DIRECTORY / overflow).exists()  # nobody will read it
    finally:
        front.close()
        worker.close()
