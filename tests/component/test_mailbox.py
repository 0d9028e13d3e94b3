"""The worker's ends of its pipe: what the inbox hands the main loop, and how the outbox sends streamed responses."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from multiprocessing.connection import Connection

import numpy as np
import pytest

from geserve.backends.python import pb_utils
from geserve.workers.mailbox import Inbox, Outbox
from geserve.workers.messages import Cancel, Partial, ReadStatus, Release, RequestInfo, RunBatch, Shutdown
from geserve.workers.runs import RunId
from geserve.workers.shm import take_tensors

RUN = RunId.current()

Ends = tuple[Connection, Connection]  # the front-end's and the worker's


@pytest.fixture
def pipe() -> Iterator[Ends]:
    front_end, worker = multiprocessing.Pipe(duplex=True)
    yield front_end, worker
    front_end.close()
    worker.close()


@pytest.mark.parametrize("threaded", [False, True])
def test_cancellations_are_recorded_and_the_rest_reaches_the_main_loop(pipe: Ends, threaded: bool) -> None:
    front_end, worker = pipe
    cancelled: set[int] = set()
    released: list[tuple[int, ...]] = []
    inbox = Inbox(worker, cancelled, Outbox(worker, RUN), threaded=threaded, release=released.append)
    try:
        assert inbox.threaded is threaded and not inbox.ready()
        front_end.send(Cancel(3))
        front_end.send(Release((1, 2)))
        front_end.send(ReadStatus())
        assert isinstance(inbox.get(), ReadStatus) and cancelled == {3} and released == [(1, 2)]
        front_end.send(Shutdown())
        assert isinstance(inbox.get(), Shutdown)
    finally:
        inbox.close()
        pb_utils.set_bls_caller(None)


def test_only_cancellations_and_releases_waiting_hand_the_main_loop_nothing(pipe: Ends) -> None:
    # The main loop reading the pipe itself is not kept waiting by messages handled here: it may turn to a batch
    # the device finished.
    front_end, worker = pipe
    cancelled: set[int] = set()
    released: list[tuple[int, ...]] = []
    inbox = Inbox(worker, cancelled, Outbox(worker, RUN), threaded=False, release=released.append)
    try:
        front_end.send(Cancel(4))
        front_end.send(Release((5,)))
        assert inbox.get() is None
        assert cancelled == {4} and released == [(5,)] and not inbox.ready()
        front_end.send(ReadStatus())
        assert isinstance(inbox.get(), ReadStatus)
    finally:
        inbox.close()


@pytest.mark.parametrize("threaded", [False, True])
def test_releases_riding_on_a_batch_are_taken_once_and_the_batch_reaches_the_main_loop(
    pipe: Ends, threaded: bool
) -> None:
    front_end, worker = pipe
    released: list[tuple[int, ...]] = []
    inbox = Inbox(worker, set(), Outbox(worker, RUN), threaded=threaded, release=released.append)
    try:
        front_end.send(RunBatch(9, (), ("OUT",), (), released=(7, 8)))
        message = inbox.get()
        assert isinstance(message, RunBatch) and message.batch_id == 9
        assert released == [(7, 8)]  # before the batch runs, and once
        front_end.send(RunBatch(10, (), ("OUT",), ()))
        assert isinstance(inbox.get(), RunBatch) and released == [(7, 8)]
    finally:
        inbox.close()
        pb_utils.set_bls_caller(None)


def test_the_front_end_gone_ends_the_inbox(pipe: Ends) -> None:
    front_end, worker = pipe
    inbox = Inbox(worker, set(), Outbox(worker, RUN), threaded=True, release=lambda batch_ids: None)
    try:
        front_end.close()
        with pytest.raises(EOFError):
            inbox.get()
    finally:
        inbox.close()
        pb_utils.set_bls_caller(None)


def test_streamed_responses_travel_inline_when_small_and_in_a_segment_when_large(pipe: Ends) -> None:
    front_end, worker = pipe
    emit = Outbox(worker, RUN).emitter((RequestInfo(1, ("OUT",), stream_id=5),))
    small, large = np.arange(4, dtype=np.float32), np.zeros(1 << 16, dtype=np.float32)
    emit(0, {"OUT": small}, None, False)
    emit(0, {"OUT": large}, None, True)
    first, last = front_end.recv(), front_end.recv()
    assert isinstance(first, Partial) and isinstance(last, Partial)
    assert first.stream_id == 5 and not first.final and first.outputs is not None and not first.refs
    np.testing.assert_array_equal(first.outputs["OUT"], small)
    assert last.final and last.outputs is None and last.refs
    np.testing.assert_array_equal(take_tensors(last.refs)["OUT"], large)
