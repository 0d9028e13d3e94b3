"""The scheduler of one model version: the dynamic batcher, or one request per batch without it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from geserve.batching.clock import Clock, LoopClock, Timer
from geserve.batching.policy import BatchingPolicy
from geserve.batching.queue import TIMEOUT_EXPIRED, PendingRequest, Reply, RequestQueue, StreamReply, UnaryReply
from geserve.errors import CancelledError, GeserveError, InternalError, UnavailableError
from geserve.types import InstanceStatus, Parameters, RequestTiming
from geserve.workers.messages import BatchResult, RequestInfo
from geserve.workers.streams import ResponseStream, StreamItem

logger = logging.getLogger(__name__)


class StatsRecorder(Protocol):
    """Where a scheduler reports what happened (core.stats.ModelStats)."""

    pending: int

    def record_success(self, timing: RequestTiming) -> None: ...

    def record_failure(self, reason: str, total_ns: int) -> None: ...

    def record_execution(self, rows: int, input_ns: int, infer_ns: int, output_ns: int) -> None: ...


class Instances(Protocol):
    """A model version's instances as its scheduler drives them (workers.pool.InstancePool)."""

    on_idle: Callable[[], None] | None

    def ready(self) -> bool: ...

    def recoverable(self) -> bool: ...

    def has_idle(self) -> bool: ...

    def has_free(self) -> bool: ...

    def dispatch(
        self,
        inputs: Mapping[str, Sequence[np.ndarray]],
        output_names: tuple[str, ...],
        requests: Sequence[RequestInfo],
        streams: Mapping[int, ResponseStream],
        *,
        keep_outputs: bool = False,
    ) -> Coroutine[Any, Any, BatchResult]: ...

    async def read_statuses(self) -> list[InstanceStatus]: ...

    async def stop(self, timeout_s: float) -> None: ...

    def kill(self) -> None: ...


class Scheduler:
    """Queues requests and hands batches to idle instances, following Triton's dynamic batcher:

    - a batch holds at most `max_batch_size` rows, and only requests with equal non-batch dims,
      taken in service order (a request that differs ends the batch);
    - the largest preferred size that can be formed goes at once, as does a full batch or one
      cut short by a differing request; otherwise whatever is queued goes once the oldest
      request has waited `max_queue_delay_microseconds`;
    - batches only form while an instance is idle, so the queue grows while all are busy.

    Without `dynamic_batching` every request is a batch of its own. Decisions are made in
    `_schedule`, called when a request arrives, an instance frees up or a timer fires: there is
    no polling loop and no task or timer per request.
    """

    def __init__(
        self,
        model_name: str,
        pool: Instances,
        policy: BatchingPolicy,
        stats: StatsRecorder,
        clock: Clock | None = None,
    ) -> None:
        self._model_name = model_name
        self._pool = pool
        pool.on_idle = self._schedule
        self._policy = policy
        self.stats = stats
        self._clock = clock or LoopClock()
        self._queue = RequestQueue(policy)
        self._sequence = 0
        self._timer: Timer | None = None
        self._timer_at: int | None = None
        self._running: set[asyncio.Task[None]] = set()
        # preserve_ordering: outcomes wait here until every earlier request has been answered.
        self._next_release = 0
        self._finished: dict[int, tuple[PendingRequest, dict[str, np.ndarray] | GeserveError]] = {}

    @property
    def policy(self) -> BatchingPolicy:
        return self._policy

    def ready(self) -> bool:
        """An instance can take work, and its model says it is ready (python models' is_ready())."""
        return self._pool.ready()

    async def read_statuses(self) -> list[InstanceStatus]:
        return await self._pool.read_statuses()

    def kill(self) -> None:
        self._pool.kill()

    async def stop(self, timeout_s: float) -> None:
        """Let running batches finish (up to `timeout_s`), then stop the instances."""
        try:
            await asyncio.wait_for(self.drain(), timeout_s)
        except TimeoutError:
            logger.warning("model '%s': batches still running at shutdown", self._model_name)
        await self._pool.stop(timeout_s)

    async def execute(
        self,
        inputs: Mapping[str, np.ndarray],
        output_names: tuple[str, ...],
        parameters: Parameters | None = None,
        request_id: str = "",
        marks: list[tuple[str, int]] | None = None,
        *,
        handoff: bool = False,
    ) -> dict[str, np.ndarray]:
        """Queue one validated request and wait for its outputs; a traced request gets its queue and
        compute timestamps appended to `marks`. With `handoff` (a pipeline's step) the outputs may be views
        of the shared memory the worker wrote them to, for the next step to read in place."""
        reply = UnaryReply()
        request = self._enqueue(inputs, output_names, parameters or {}, request_id, reply, handoff=handoff)
        request.marks = marks
        try:
            return await reply.future
        except asyncio.CancelledError:
            if self._withdraw(request):
                self.stats.record_failure("CANCELED", self._clock.now_ns() - request.enqueued_ns)
                self._finish(request, CancelledError("request cancelled"))
                self._schedule()
            raise

    async def stream(
        self,
        inputs: Mapping[str, np.ndarray],
        output_names: tuple[str, ...],
        parameters: Parameters | None = None,
        request_id: str = "",
    ) -> AsyncIterator[StreamItem]:
        """Queue one request of a decoupled model and yield its responses as they come: (outputs or
        None, an error or None, final). A failure before the model answers ends the stream with it."""
        reply = StreamReply()
        request = self._enqueue(inputs, output_names, parameters or {}, request_id, reply)
        finished = False
        try:
            async for outputs, error, finished in reply.stream.responses():
                if finished:
                    self._record_stream_end(request, error)
                yield outputs, error, finished
        finally:
            if not finished:
                self._abandon(request, reply.stream)

    def _record_stream_end(self, request: PendingRequest, error: GeserveError | None) -> None:
        now = self._clock.now_ns()
        if request.dispatched_ns == 0:
            return  # failed in the queue: already counted
        if error is None:
            queue_ns = request.dispatched_ns - request.enqueued_ns
            self.stats.record_success(RequestTiming(now - request.enqueued_ns, queue_ns, 0, 0, 0))
        else:
            self.stats.record_failure("BACKEND", now - request.enqueued_ns)

    def _abandon(self, request: PendingRequest, stream: ResponseStream) -> None:
        """The client of a stream went away: out of the queue, or the model is told."""
        if self._withdraw(request):
            self.stats.record_failure("CANCELED", self._clock.now_ns() - request.enqueued_ns)
            self._schedule()
        else:
            # Running in the model: it is told, and the request ends as Triton ends it, a CANCELED failure.
            self.stats.record_failure("CANCELED", self._clock.now_ns() - request.enqueued_ns)
            stream.cancel()

    def _withdraw(self, request: PendingRequest) -> bool:
        """Take a request its client gave up on out of the queue; False when it already runs."""
        if not self._queue.remove(request):
            return False
        self.stats.pending = len(self._queue)
        return True

    def _enqueue(
        self,
        inputs: Mapping[str, np.ndarray],
        output_names: tuple[str, ...],
        parameters: Parameters,
        request_id: str,
        reply: Reply,
        *,
        handoff: bool = False,
    ) -> PendingRequest:
        if not self._pool.recoverable():
            raise UnavailableError(f"model '{self._model_name}' has no running instance")
        now = self._clock.now_ns()
        request = self._pending(inputs, output_names, parameters, now, reply)
        request.request_id = request_id
        request.handoff = handoff
        try:
            self._queue.push(request)
        except UnavailableError:
            self.stats.record_failure("REJECTED", 0)
            raise
        self._sequence += 1
        self.stats.pending = len(self._queue)
        self._schedule()
        return request

    def _pending(
        self,
        inputs: Mapping[str, np.ndarray],
        output_names: tuple[str, ...],
        parameters: Parameters,
        now: int,
        reply: Reply,
    ) -> PendingRequest:
        batched = self._policy.max_batch_size > 0
        first = next(iter(inputs.values()), None)
        rows = int(first.shape[0]) if batched and first is not None and first.ndim else 1
        shape_key = tuple(tuple(array.shape[1:]) if batched else tuple(array.shape) for array in inputs.values())
        priority = parameters.get("priority")
        level = self._policy.level(priority if isinstance(priority, int) else None)
        timeout = parameters.get("timeout")
        timeout_ns = self._policy.queue_policies[level - 1].timeout_ns(timeout if isinstance(timeout, int) else None)
        return PendingRequest(
            sequence=self._sequence,
            inputs=inputs,
            output_names=output_names,
            rows=rows,
            shape_key=shape_key,
            level=level,
            enqueued_ns=now,
            deadline_ns=now + timeout_ns if timeout_ns else None,
            reply=reply,
            parameters=parameters,
        )

    # -- decisions ---------------------------------------------------------------------------

    def _schedule(self) -> None:
        now = self._clock.now_ns()
        for request in self._queue.expire(now):
            self.stats.record_failure("REJECTED", now - request.enqueued_ns)
            self._finish(request, UnavailableError(TIMEOUT_EXPIRED))
        wake_at: int | None = None
        while self._queue and self._pool.has_idle():
            # Only slots behind running batches are left: a batch goes there only when it is full, since
            # the device cannot start it earlier anyway, and meanwhile it can still grow.
            behind = not self._pool.has_free()
            count, wait_until = self._batch_size(now, behind)
            if count == 0:
                wake_at = wait_until
                break
            self._dispatch(self._queue.pop_front(count), now)
        if self._queue and not self._pool.recoverable():
            self._fail_queued(UnavailableError(f"model '{self._model_name}' has no running instance"))
        self.stats.pending = len(self._queue)
        deadline = self._queue.next_deadline()
        if deadline is not None:
            wake_at = deadline if wake_at is None else min(wake_at, deadline)
        self._set_timer(wake_at)

    def _batch_size(self, now: int, behind: bool = False) -> tuple[int, int | None]:
        """How many queued requests to send now, or 0 and when to look again (None: when a batch finishes
        or a request comes). `behind`: the batch would wait behind a running one, so it goes only when full."""
        policy = self._policy
        if not policy.dynamic:
            return 1, None
        rows = count = preferred_count = preferred_rows = 0
        first: PendingRequest | None = None
        complete = False  # full, or cut short by a request that cannot join
        for request in self._queue.in_order():
            if first is None:
                first = request
            elif request.shape_key != first.shape_key or rows + request.rows > policy.max_batch_size:
                complete = True
                break
            rows += request.rows
            count += 1
            if rows in policy.preferred_sizes:
                preferred_count, preferred_rows = count, rows
            if rows >= policy.max_batch_size:
                complete = True
                break
        if complete:
            return count, None
        if behind:
            full = bool(policy.preferred_sizes) and preferred_rows == policy.preferred_sizes[-1]
            return (preferred_count, None) if full else (0, None)
        if preferred_count:
            return preferred_count, None
        assert first is not None
        ready_at = first.enqueued_ns + policy.max_delay_ns
        if policy.max_delay_ns == 0 or now >= ready_at:
            return count, None
        return 0, ready_at

    def _set_timer(self, when_ns: int | None) -> None:
        if when_ns == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = None, when_ns
        if when_ns is not None:
            self._timer = self._clock.call_at(when_ns, self._on_timer)

    def _on_timer(self) -> None:
        self._timer, self._timer_at = None, None
        self._schedule()

    def _fail_queued(self, error: GeserveError) -> None:
        now = self._clock.now_ns()
        for request in self._queue.pop_front(len(self._queue)):
            self.stats.record_failure("OTHER", now - request.enqueued_ns)
            self._finish(request, error)

    # -- execution ---------------------------------------------------------------------------

    def _dispatch(self, batch: list[PendingRequest], now: int) -> None:
        """Hand a batch to an idle instance: each input as the requests' row blocks (the worker lays them
        out contiguously), the union of the outputs they asked for, and each request's own details."""
        wanted: dict[str, None] = {}
        for request in batch:
            request.dispatched_ns = now
            wanted.update(dict.fromkeys(request.output_names))
        inputs = {name: [request.inputs[name] for request in batch] for name in batch[0].inputs}
        infos = [RequestInfo(r.rows, r.output_names, r.request_id, r.parameters) for r in batch]
        streams = {i: r.reply.stream for i, r in enumerate(batch) if isinstance(r.reply, StreamReply)}
        keep = any(request.handoff for request in batch)
        run = self._pool.dispatch(inputs, tuple(wanted), infos, streams, keep_outputs=keep)
        self._start_task(self._run(run, batch, now))

    def _start_task(self, run: Coroutine[Any, Any, None]) -> None:
        """Run a batch's await-and-deliver as a task that `drain` waits for."""
        task = asyncio.get_running_loop().create_task(run)
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _run(
        self, run: Coroutine[Any, Any, BatchResult], batch: list[PendingRequest], dispatched_ns: int
    ) -> None:
        try:
            result = await run
            if len(result.results) != len(batch):
                answered = len(result.results)
                raise InternalError(f"model '{self._model_name}': {answered} results for {len(batch)} requests")
        except Exception as failure:
            self._fail_batch(batch, failure)
        else:
            self._deliver(batch, result, dispatched_ns)
        self._schedule()

    def _fail_batch(self, batch: Sequence[PendingRequest], failure: Exception) -> None:
        """A batch that did not run: every request gets its error."""
        if not isinstance(failure, GeserveError):
            logger.exception("model '%s': batch failed", self._model_name, exc_info=failure)
            failure = InternalError(f"{type(failure).__name__}: {failure}")
        done_ns = self._clock.now_ns()
        for request in batch:
            self.stats.record_failure("OTHER", done_ns - request.enqueued_ns)
            self._finish(request, failure)

    def _deliver(self, batch: Sequence[PendingRequest], result: BatchResult, dispatched_ns: int) -> None:
        """Each request gets its own result: its outputs, or its own error."""
        done_ns = self._clock.now_ns()
        input_ns = max(result.infer_start_ns - dispatched_ns, 0)
        infer_ns = max(result.infer_end_ns - result.infer_start_ns, 0)
        output_ns = max(done_ns - result.infer_end_ns, 0)
        if not all(isinstance(outcome, GeserveError) for outcome in result.results):
            self.stats.record_execution(sum(r.rows for r in batch), input_ns, infer_ns, output_ns)
        for request, outcome in zip(batch, result.results, strict=True):
            if isinstance(outcome, GeserveError):
                self.stats.record_failure("BACKEND", done_ns - request.enqueued_ns)
                self._finish(request, outcome)
                continue
            if request.marks is not None:
                _mark(request, result, done_ns)
            if request.reply.ends_with_batch:
                queue_ns = request.dispatched_ns - request.enqueued_ns
                timing = RequestTiming(done_ns - request.enqueued_ns, queue_ns, input_ns, infer_ns, output_ns)
                self.stats.record_success(timing)
            self._finish(request, outcome)

    def _finish(self, request: PendingRequest, outcome: dict[str, np.ndarray] | GeserveError) -> None:
        """Answer a request, in arrival order when preserve_ordering asks for it."""
        if not self._policy.preserve_ordering:
            _resolve(request, outcome)
            return
        self._finished[request.sequence] = (request, outcome)
        while self._next_release in self._finished:
            _resolve(*self._finished.pop(self._next_release))
            self._next_release += 1

    async def drain(self) -> None:
        """Wait until every request admitted so far has been answered: the queued ones get batches as
        instances free up, so this waits for them too while any instance can still take them."""
        while self._running or (self._has_queued() and self._pool.recoverable()):
            if self._running:
                await asyncio.gather(*list(self._running), return_exceptions=True)
            else:
                await asyncio.sleep(0.005)  # queued behind a restarting instance

    def _has_queued(self) -> bool:
        return bool(self._queue)


def _mark(request: PendingRequest, result: BatchResult, done_ns: int) -> None:
    assert request.marks is not None
    request.marks.extend(
        (
            ("QUEUE_START", request.enqueued_ns),
            ("COMPUTE_START", request.dispatched_ns),
            ("COMPUTE_INPUT_END", result.infer_start_ns),
            ("COMPUTE_OUTPUT_START", result.infer_end_ns),
            ("COMPUTE_END", done_ns),
        )
    )


def _resolve(request: PendingRequest, outcome: dict[str, np.ndarray] | GeserveError) -> None:
    if isinstance(outcome, GeserveError):
        request.reply.fail(outcome)
    else:
        request.reply.succeed(outcome)
