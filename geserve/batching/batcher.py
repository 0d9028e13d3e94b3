"""The scheduler of one model version: the dynamic batcher, or one request per batch without it."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Protocol

import numpy as np

from geserve.batching.clock import Clock, LoopClock, Timer
from geserve.batching.policy import BatchingPolicy
from geserve.batching.queue import TIMEOUT_EXPIRED, PendingRequest, RequestQueue
from geserve.errors import CancelledError, GeserveError, InternalError, UnavailableError
from geserve.types import Parameters, RequestTiming
from geserve.workers.client import ResponseSink, WorkerClient
from geserve.workers.messages import Executed, RequestInfo

logger = logging.getLogger(__name__)


class StatsRecorder(Protocol):
    """Where a scheduler reports what happened (core.stats.ModelStats)."""

    pending: int

    def record_success(self, timing: RequestTiming) -> None: ...

    def record_failure(self, reason: str, total_ns: int) -> None: ...

    def record_execution(self, rows: int, input_ns: int, infer_ns: int, output_ns: int) -> None: ...


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
        instances: Sequence[WorkerClient],
        policy: BatchingPolicy,
        stats: StatsRecorder,
        clock: Clock | None = None,
        *,
        describe_requests: bool = False,
    ) -> None:
        self._model_name = model_name
        # Backends that answer request by request (python) get each request's id, rows and parameters.
        self._describe_requests = describe_requests
        self._instances = list(instances)
        # One entry per batch an instance can take at once, interleaved so batches spread first.
        depth = max((instance.capacity for instance in self._instances), default=1)
        self._idle: deque[WorkerClient] = deque(
            instance for slot in range(depth) for instance in self._instances if slot < instance.capacity
        )
        self._busy: dict[int, int] = {}  # id(instance) -> batches it holds now
        for instance in self._instances:
            instance.on_ready = self._instance_ready
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
        self._finished: dict[int, tuple[PendingRequest, dict[str, np.ndarray] | BaseException]] = {}

    @property
    def instances(self) -> list[WorkerClient]:
        return list(self._instances)

    @property
    def policy(self) -> BatchingPolicy:
        return self._policy

    def any_alive(self) -> bool:
        return any(instance.alive for instance in self._instances)

    def ready(self) -> bool:
        """An instance can take work, and its model says it is ready (python models' is_ready())."""
        return any(instance.alive and instance.model_ready for instance in self._instances)

    def _any_recoverable(self) -> bool:
        return any(instance.recoverable for instance in self._instances)

    def _instance_ready(self, instance: WorkerClient) -> None:
        """A restarted instance is back: its free slots rejoin the idle pool and take queued work."""
        held = sum(1 for entry in self._idle if entry is instance) + self._busy.get(id(instance), 0)
        self._idle.extend([instance] * max(instance.capacity - held, 0))
        self._schedule()

    async def execute(
        self,
        inputs: Mapping[str, np.ndarray],
        output_names: tuple[str, ...],
        parameters: Parameters | None = None,
        request_id: str = "",
        marks: list[tuple[str, int]] | None = None,
    ) -> dict[str, np.ndarray]:
        """Queue one validated request and wait for its outputs; a traced request gets its queue and
        compute timestamps appended to `marks`."""
        request = self._enqueue(inputs, output_names, parameters or {}, request_id, None)
        request.marks = marks
        try:
            return await request.future
        except asyncio.CancelledError:
            if self._queue.remove(request):
                self.stats.pending = len(self._queue)
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
    ) -> AsyncIterator[tuple[dict[str, np.ndarray] | None, GeserveError | None, bool]]:
        """Queue one request of a decoupled model and yield its responses as they come: (outputs or
        None, an error or None, final). A failure before the model answers ends the stream with it."""
        responses: asyncio.Queue[tuple[dict[str, np.ndarray] | None, GeserveError | None, bool]] = asyncio.Queue()
        request = self._enqueue(
            inputs, output_names, parameters or {}, request_id, lambda *response: responses.put_nowait(response)
        )
        finished = False
        try:
            while not finished:
                outputs, error, finished = await responses.get()
                if finished:
                    self._record_stream_end(request, error)
                yield outputs, error, finished
        finally:
            if not finished:
                self._abandon(request)

    def _record_stream_end(self, request: PendingRequest, error: GeserveError | None) -> None:
        now = self._clock.now_ns()
        if request.dispatched_ns == 0:
            return  # failed in the queue: already counted
        if error is None:
            queue_ns = request.dispatched_ns - request.enqueued_ns
            self.stats.record_success(RequestTiming(now - request.enqueued_ns, queue_ns, 0, 0, 0))
        else:
            self.stats.record_failure("BACKEND", now - request.enqueued_ns)

    def _abandon(self, request: PendingRequest) -> None:
        """The client of a stream went away: out of the queue, or the model is told."""
        if self._queue.remove(request):
            self.stats.pending = len(self._queue)
            self.stats.record_failure("CANCELED", self._clock.now_ns() - request.enqueued_ns)
            self._schedule()
        elif request.sink is not None:
            # Running in the model: it is told, and the request ends as Triton ends it, a CANCELED failure.
            self.stats.record_failure("CANCELED", self._clock.now_ns() - request.enqueued_ns)
            for instance in self._instances:
                instance.cancel_stream(request.sink)

    def _enqueue(
        self,
        inputs: Mapping[str, np.ndarray],
        output_names: tuple[str, ...],
        parameters: Parameters,
        request_id: str,
        sink: ResponseSink | None,
    ) -> PendingRequest:
        if not self._any_recoverable():
            raise UnavailableError(f"model '{self._model_name}' has no running instance")
        now = self._clock.now_ns()
        request = self._pending(inputs, output_names, parameters, now)
        request.request_id, request.sink = request_id, sink
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
        self, inputs: Mapping[str, np.ndarray], output_names: tuple[str, ...], parameters: Parameters, now: int
    ) -> PendingRequest:
        batched = self._policy.max_batch_size > 0
        first = next(iter(inputs.values()), None)
        rows = int(first.shape[0]) if batched and first is not None and first.ndim else 1
        shape_key = tuple(tuple(array.shape[1:]) if batched else tuple(array.shape) for array in inputs.values())
        priority = parameters.get("priority")
        level = self._policy.level(priority if isinstance(priority, int) else None)
        timeout = parameters.get("timeout")
        timeout_ns = self._policy.queue_policies[level - 1].timeout_ns(timeout if isinstance(timeout, int) else None)
        future: asyncio.Future[dict[str, np.ndarray]] = asyncio.get_running_loop().create_future()
        return PendingRequest(
            sequence=self._sequence,
            inputs=inputs,
            output_names=output_names,
            rows=rows,
            shape_key=shape_key,
            level=level,
            enqueued_ns=now,
            deadline_ns=now + timeout_ns if timeout_ns else None,
            future=future,
            parameters=parameters,
        )

    # -- decisions ---------------------------------------------------------------------------

    def _schedule(self) -> None:
        now = self._clock.now_ns()
        for request in self._queue.expire(now):
            self.stats.record_failure("REJECTED", now - request.enqueued_ns)
            self._finish(request, UnavailableError(TIMEOUT_EXPIRED))
        wake_at: int | None = None
        while self._queue and self._idle:
            count, wait_until = self._batch_size(now)
            if count == 0:
                wake_at = wait_until
                break
            instance = self._idle.popleft()
            if not instance.alive:
                continue  # a dead instance leaves the pool; the others keep serving
            batch = self._queue.pop_front(count)
            for request in batch:
                request.dispatched_ns = now
            self._busy[id(instance)] = self._busy.get(id(instance), 0) + 1
            task = asyncio.get_running_loop().create_task(self._run(instance, batch, now))
            self._running.add(task)
            task.add_done_callback(self._running.discard)
        if self._queue and not self._any_recoverable():
            self._fail_queued(UnavailableError(f"model '{self._model_name}' has no running instance"))
        self.stats.pending = len(self._queue)
        deadline = self._queue.next_deadline()
        if deadline is not None:
            wake_at = deadline if wake_at is None else min(wake_at, deadline)
        self._set_timer(wake_at)

    def _batch_size(self, now: int) -> tuple[int, int | None]:
        """How many queued requests to send now, or 0 and when to look again."""
        policy = self._policy
        if not policy.dynamic:
            return 1, None
        rows = count = preferred_count = 0
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
                preferred_count = count
            if rows >= policy.max_batch_size:
                complete = True
                break
        if complete:
            return count, None
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

    async def _run(self, instance: WorkerClient, batch: list[PendingRequest], dispatched_ns: int) -> None:
        try:
            inputs, output_names = self._batch_inputs(batch)
            if self._describe_requests:
                infos = [
                    RequestInfo(r.rows, r.request_id, dict(r.parameters), r.output_names) for r in batch
                ]  # fmt: skip
                executed = await instance.execute(inputs, output_names, infos, [r.sink for r in batch])
            else:
                executed = await instance.execute(inputs, output_names)
            error: GeserveError | None = executed.error
            reason = "BACKEND"
        except GeserveError as failure:
            executed, error, reason = None, failure, "OTHER"
        except Exception as failure:
            logger.exception("model '%s': batch failed", self._model_name)
            executed, error, reason = None, InternalError(f"{type(failure).__name__}: {failure}"), "OTHER"
        finally:
            self._busy[id(instance)] -= 1
            self._idle.append(instance)
        done_ns = self._clock.now_ns()
        if executed is not None and error is None:
            try:
                self._deliver(batch, executed, dispatched_ns, done_ns)
            except GeserveError as failure:
                error, reason = failure, "BACKEND"
        if error is not None:
            for request in batch:
                self.stats.record_failure(reason, done_ns - request.enqueued_ns)
                self._finish(request, error)
        self._schedule()

    def _batch_inputs(self, batch: list[PendingRequest]) -> tuple[dict[str, list[np.ndarray]], tuple[str, ...]]:
        """Each input as the requests' row blocks (the worker lays them out contiguously), and the
        union of the outputs they asked for."""
        wanted: dict[str, None] = {}
        for request in batch:
            wanted.update(dict.fromkeys(request.output_names))
        names = batch[0].inputs.keys()
        return {name: [request.inputs[name] for request in batch] for name in names}, tuple(wanted)

    def _deliver(self, batch: list[PendingRequest], executed: Executed, dispatched_ns: int, done_ns: int) -> None:
        if executed.responses is not None or any(request.sink is not None for request in batch):
            self._deliver_each(batch, executed, dispatched_ns, done_ns)
            return
        outputs = executed.outputs or {}
        rows = sum(request.rows for request in batch)
        batched = self._policy.max_batch_size > 0
        if batched and len(batch) > 1:
            for name, array in outputs.items():
                returned = array.shape[0] if array.ndim else 0
                if returned != rows:
                    raise InternalError(
                        f"model '{self._model_name}' returned output '{name}' with {returned} rows "
                        f"for a batch of {rows}"
                    )
        compute = self._record_execution(rows, executed, dispatched_ns, done_ns)
        offset = 0
        for request in batch:
            if len(batch) == 1:
                result = {name: outputs[name] for name in request.output_names}
            else:
                result = {name: outputs[name][offset : offset + request.rows] for name in request.output_names}
            offset += request.rows
            self._succeed(request, result, executed, compute, done_ns)

    def _deliver_each(self, batch: list[PendingRequest], executed: Executed, dispatched_ns: int, done_ns: int) -> None:
        """Requests answered one by one: each with its own outputs or error, or, when streamed, later."""
        compute = self._record_execution(sum(r.rows for r in batch), executed, dispatched_ns, done_ns)
        responses = executed.responses or ()
        for index, request in enumerate(batch):
            if request.sink is not None:
                continue  # a decoupled model answers through the stream
            result: dict[str, np.ndarray] | GeserveError = (
                responses[index]
                if index < len(responses)
                else InternalError(f"model '{self._model_name}' returned no response for a request")
            )
            if isinstance(result, GeserveError):
                self.stats.record_failure("BACKEND", done_ns - request.enqueued_ns)
                self._finish(request, result)
                continue
            self._succeed(
                request, {n: result[n] for n in request.output_names if n in result}, executed, compute, done_ns
            )

    def _record_execution(
        self, rows: int, executed: Executed, dispatched_ns: int, done_ns: int
    ) -> tuple[int, int, int]:
        """Count one execution of `rows` rows; returns its compute input, infer and output times."""
        input_ns = max(executed.infer_start_ns - dispatched_ns, 0)
        infer_ns = max(executed.infer_end_ns - executed.infer_start_ns, 0)
        output_ns = max(done_ns - executed.infer_end_ns, 0)
        self.stats.record_execution(rows, input_ns, infer_ns, output_ns)
        return input_ns, infer_ns, output_ns

    def _succeed(
        self,
        request: PendingRequest,
        result: dict[str, np.ndarray],
        executed: Executed,
        compute: tuple[int, int, int],
        done_ns: int,
    ) -> None:
        if request.marks is not None:
            _mark(request, executed, done_ns)
        queue_ns = request.dispatched_ns - request.enqueued_ns
        self.stats.record_success(RequestTiming(done_ns - request.enqueued_ns, queue_ns, *compute))
        self._finish(request, result)

    def _finish(self, request: PendingRequest, outcome: dict[str, np.ndarray] | BaseException) -> None:
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
        while self._running or (self._queue and self._any_recoverable()):
            if self._running:
                await asyncio.gather(*list(self._running), return_exceptions=True)
            else:
                await asyncio.sleep(0.005)  # queued behind a restarting instance


def _mark(request: PendingRequest, executed: Executed, done_ns: int) -> None:
    assert request.marks is not None
    request.marks.extend(
        (
            ("QUEUE_START", request.enqueued_ns),
            ("COMPUTE_START", request.dispatched_ns),
            ("COMPUTE_INPUT_END", executed.infer_start_ns),
            ("COMPUTE_OUTPUT_START", executed.infer_end_ns),
            ("COMPUTE_END", done_ns),
        )
    )


def _resolve(request: PendingRequest, outcome: dict[str, np.ndarray] | BaseException) -> None:
    if request.sink is not None and isinstance(outcome, BaseException):
        error = outcome if isinstance(outcome, GeserveError) else InternalError(str(outcome))
        request.sink(None, error, True)
    if request.future.done():
        return  # the client went away
    if isinstance(outcome, BaseException):
        request.future.set_exception(outcome)
    else:
        request.future.set_result(outcome)
