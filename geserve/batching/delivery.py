"""Delivery: answers the requests of a model version's batches, for the dynamic and the sequence batcher alike."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any, Protocol

from geserve import log_records
from geserve.batching.clock import Clock
from geserve.batching.queue import PendingRequest, Reply, StreamReply, UnaryReply
from geserve.batching.request import RequestTimestamps, ScheduledRequest, ScheduledResponse
from geserve.errors import CancelledError, GeserveError, InternalError
from geserve.residency import SharedTensor
from geserve.types import RequestTiming
from geserve.workers.messages import BatchResult
from geserve.workers.streams import StreamItem

logger = logging.getLogger(__name__)

Outcome = dict[str, SharedTensor] | GeserveError
# A scheduler's own admission: queues a request (or refuses it with its error) and decides what runs now.
Enqueue = Callable[[ScheduledRequest, Reply], PendingRequest]
# Takes a request its client gave up on out of its scheduler's queue; False when it already runs.
Withdraw = Callable[[PendingRequest], bool]
# Where a submitted request's outcome goes: its outputs, or its error.
Done = Callable[[Outcome], None]


class StatsRecorder(Protocol):
    """Where a scheduler reports what happened (core.stats.ModelStats)."""

    pending: int

    def record_success(self, timing: RequestTiming) -> None: ...

    def record_failure(self, reason: str, total_ns: int) -> None: ...

    def record_execution(self, rows: int, input_ns: int, infer_ns: int, output_ns: int) -> None: ...


class Delivery:
    """What the dynamic and the sequence batcher share around their own queueing: admits a request through
    the scheduler's `enqueue` and waits for its answer (withdrawing it when its client goes away), runs
    batches as tasks, splits a batch's result into its requests' outcomes, records the statistics, and
    answers in arrival order when `preserve_ordering` asks for it. After a batch or a withdrawal it calls
    `reschedule`, the scheduler's decision step."""

    def __init__(
        self,
        model_name: str,
        stats: StatsRecorder,
        clock: Clock,
        reschedule: Callable[[], None],
        preserve_ordering: bool = False,
    ) -> None:
        self._model_name, self._stats, self._clock = model_name, stats, clock
        self._reschedule = reschedule
        self._running: set[asyncio.Task[None]] = set()  # batches not yet delivered
        self._preserve_ordering = preserve_ordering
        # preserve_ordering: outcomes wait here until every earlier request has been answered.
        self._next_release = 0
        self._finished: dict[int, tuple[PendingRequest, Outcome]] = {}

    # -- the request's side ------------------------------------------------------------------

    async def execute(self, request: ScheduledRequest, enqueue: Enqueue, withdraw: Withdraw) -> ScheduledResponse:
        """Queue a request and wait for its outputs, with the timestamps of its batch."""
        reply = UnaryReply()
        pending = enqueue(request, reply)
        assert reply.future is not None
        try:
            outputs = await reply.future
        except asyncio.CancelledError:
            self.cancel(pending, withdraw)
            raise
        return ScheduledResponse(outputs, pending.timestamps)

    def submit(self, request: ScheduledRequest, enqueue: Enqueue, done: Done) -> PendingRequest:
        """Queue a request whose outcome goes to `done` (its outputs, or its error) once its batch is back: no
        future and no task of its own. Returns it, for `cancel`."""
        return enqueue(request, UnaryReply(done))

    def cancel(self, pending: PendingRequest, withdraw: Withdraw) -> None:
        """The client of a unary request went away: out of the queue (answered as cancelled), or, when its batch
        runs, the model is told and the request ends as Triton ends a cancelled one, a CANCELED failure; what its
        batch still answers for it is dropped."""
        reply = pending.reply
        assert isinstance(reply, UnaryReply)
        if withdraw(pending):
            self.end(pending, "CANCELED", CancelledError("request cancelled"))
            self._reschedule()
        elif not pending.counted:
            self._stats.record_failure("CANCELED", self._clock.now_ns() - pending.enqueued_ns)
            reply.cancel()

    async def stream(
        self, request: ScheduledRequest, enqueue: Enqueue, withdraw: Withdraw
    ) -> AsyncIterator[StreamItem]:
        """Queue a request of a decoupled model and yield its responses as they come; a failure before the
        model answers ends the stream with it."""
        reply = StreamReply()
        pending = enqueue(request, reply)
        finished = False
        try:
            async for outputs, error, finished in reply.stream.responses():
                if pending.turn is not None:
                    # In order: the responses wait (in the stream) until earlier requests have ended theirs.
                    await pending.turn.wait()
                    if finished:
                        pending.turn.finish()
                if finished:
                    self._record_stream_end(pending, error)
                yield outputs, error, finished
        finally:
            if pending.turn is not None:
                pending.turn.finish()
            if not finished:
                # The client went away: out of the queue, or the model is told; the request ends as Triton
                # ends it, a CANCELED failure.
                self._stats.record_failure("CANCELED", self._clock.now_ns() - pending.enqueued_ns)
                if withdraw(pending):
                    self._reschedule()
                else:
                    reply.stream.cancel()

    def _record_stream_end(self, request: PendingRequest, error: GeserveError | None) -> None:
        now = self._clock.now_ns()
        if request.dispatched_ns == 0:
            return  # failed in the queue: already counted
        if error is None:
            queue_ns = request.dispatched_ns - request.enqueued_ns
            self._stats.record_success(RequestTiming(now - request.enqueued_ns, queue_ns, 0, 0, 0))
        else:
            self._stats.record_failure("BACKEND", now - request.enqueued_ns)

    # -- the batch's side --------------------------------------------------------------------

    def start(
        self,
        run: Coroutine[Any, Any, BatchResult],
        rows: Sequence[PendingRequest | None],
        dispatched_ns: int,
        then: Callable[[], None] | None = None,
    ) -> None:
        """Await a dispatched batch as a task `drain` waits for, and deliver its result to the requests of
        its rows (None: a row of padding, whose result is dropped); then `then`, and a new decision."""
        task = asyncio.get_running_loop().create_task(self._run(run, rows, dispatched_ns, then))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _run(
        self,
        run: Coroutine[Any, Any, BatchResult],
        rows: Sequence[PendingRequest | None],
        dispatched_ns: int,
        then: Callable[[], None] | None,
    ) -> None:
        requests = [request for request in rows if request is not None]
        try:
            result = await run
            if len(result.results) != len(rows):
                answered = len(result.results)
                raise InternalError(f"model '{self._model_name}': {answered} results for {len(rows)} requests")
        except Exception as failure:
            self.fail(requests, failure)
        else:
            if len(requests) != len(rows):
                own = tuple(outcome for request, outcome in zip(rows, result.results, strict=True) if request)
                result = BatchResult(own, result.infer_start_ns, result.infer_end_ns)
            self._deliver(requests, result, dispatched_ns)
        if then is not None:
            then()
        self._reschedule()

    def _deliver(self, batch: Sequence[PendingRequest], result: BatchResult, dispatched_ns: int) -> None:
        """Each request gets its own result: its outputs, or its own error."""
        done_ns = self._clock.now_ns()
        input_ns = max(result.infer_start_ns - dispatched_ns, 0)
        infer_ns = max(result.infer_end_ns - result.infer_start_ns, 0)
        output_ns = max(done_ns - result.infer_end_ns, 0)
        if not all(isinstance(outcome, GeserveError) for outcome in result.results):
            self._stats.record_execution(sum(r.rows for r in batch), input_ns, infer_ns, output_ns)
        for request, outcome in zip(batch, result.results, strict=True):
            if isinstance(outcome, GeserveError):
                self.end(request, "BACKEND", outcome)
                continue
            request.timestamps = RequestTimestamps(
                request.enqueued_ns, request.dispatched_ns, result.infer_start_ns, result.infer_end_ns, done_ns
            )
            if request.reply.ends_with_batch and not _abandoned(request):
                request.counted = True
                queue_ns = request.dispatched_ns - request.enqueued_ns
                timing = RequestTiming(done_ns - request.enqueued_ns, queue_ns, input_ns, infer_ns, output_ns)
                self._stats.record_success(timing)
            self.finish(request, outcome)

    def fail(self, requests: Sequence[PendingRequest], failure: Exception) -> None:
        """Requests whose batch did not run (or that cannot get one): every one gets the error."""
        if not isinstance(failure, GeserveError):
            fields = log_records.request_fields(self._model_name)
            logger.exception("model '%s': batch failed", self._model_name, exc_info=failure, extra=fields)
            failure = InternalError(f"{type(failure).__name__}: {failure}")
        for request in requests:
            self.end(request, "OTHER", failure)

    def end(self, request: PendingRequest, reason: str, error: GeserveError) -> None:
        """A request fails: counted as a failure for `reason` (unless its client went away while it ran, counted
        then), and answered with `error`."""
        if not _abandoned(request):
            request.counted = True
            self._stats.record_failure(reason, self._clock.now_ns() - request.enqueued_ns)
        self.finish(request, error)

    def finish(self, request: PendingRequest, outcome: Outcome) -> None:
        """Answer a request, in arrival order when preserve_ordering asks for it (in its instance's dispatch
        order when it has a turn there)."""
        turn = request.turn
        if turn is not None and isinstance(request.reply, UnaryReply):

            def answer() -> None:
                _resolve(request, outcome)
                turn.finish()

            turn.when_due(answer)
            return
        if not self._preserve_ordering:
            _resolve(request, outcome)
            return
        self._finished[request.sequence] = (request, outcome)
        while self._next_release in self._finished:
            _resolve(*self._finished.pop(self._next_release))
            self._next_release += 1

    async def drain(self, queued: Callable[[], bool]) -> None:
        """Wait until every running batch has been delivered and nothing is `queued` any more (the queued
        requests get batches as instances free up, so this waits for them too)."""
        while self._running or queued():
            if self._running:
                await asyncio.gather(*list(self._running), return_exceptions=True)
            else:
                await asyncio.sleep(0.005)  # queued behind a restarting instance


def _abandoned(request: PendingRequest) -> bool:
    """A unary request whose client went away while it ran: counted then; its outcome is dropped (in its turn)."""
    reply = request.reply
    return isinstance(reply, UnaryReply) and reply.cancelled


def _resolve(request: PendingRequest, outcome: Outcome) -> None:
    if isinstance(outcome, GeserveError):
        request.reply.fail(outcome)
    else:
        request.reply.succeed(outcome)
