"""The scheduler of one model version: the dynamic batcher, or one request per batch without it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, Protocol

from geserve.batching.clock import Alarm, Clock, LoopClock
from geserve.batching.cycles import cycle_error, self_waits
from geserve.batching.delivery import Delivery, Done, StatsRecorder
from geserve.batching.policy import BatchingPolicy
from geserve.batching.queue import (
    TIMEOUT_EXPIRED,
    PendingRequest,
    Reply,
    RequestQueue,
    answer_routes,
    pending_request,
)
from geserve.batching.request import ScheduledRequest, ScheduledResponse
from geserve.errors import UnavailableError
from geserve.residency import SharedTensor
from geserve.types import merge_chains
from geserve.workers.batch import Batch
from geserve.workers.messages import BatchResult, RequestInfo
from geserve.workers.streams import StreamItem


class Instances(Protocol):
    """A model version's instances as its scheduler drives them (workers.pool.InstancePool)."""

    # Called when a restarted instance's slots are back, so queued work can go to them.
    on_idle: Callable[[], None] | None

    # Every instance is passive (instance_group.passive): loaded, but none takes requests.
    passive_only: bool

    def recoverable(self) -> bool: ...

    def has_idle(self) -> bool: ...

    def has_free(self) -> bool: ...

    def instance_names(self) -> frozenset[tuple[int, str]]: ...

    def dispatch(self, batch: Batch) -> Coroutine[Any, Any, BatchResult]: ...


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
        self._alarm = Alarm(self._clock, self._schedule)
        self._delivery = Delivery(model_name, stats, self._clock, self._schedule, policy.preserve_ordering)
        # Queued BLS calls made by this model's own instances (some may have left the queue since).
        self._self_calls: list[PendingRequest] = []

    async def execute(self, request: ScheduledRequest) -> ScheduledResponse:
        """Queue one validated request and wait for its outputs and the timestamps of its batch."""
        return await self._delivery.execute(request, self._enqueue, self._withdraw)

    def submit(self, request: ScheduledRequest, done: Done) -> PendingRequest:
        """Queue one validated request whose outcome (outputs or error) goes to `done` when its batch is back;
        returns it, for `cancel`. A full queue refuses it with its error, raised here."""
        return self._delivery.submit(request, self._enqueue, done)

    def cancel(self, pending: PendingRequest) -> None:
        """A submitted request's client went away."""
        self._delivery.cancel(pending, self._withdraw)

    def stream(self, request: ScheduledRequest) -> AsyncIterator[StreamItem]:
        """Queue one request of a decoupled model (when iterated) and yield its responses as they come:
        (outputs or None, an error or None, final)."""
        return self._delivery.stream(request, self._enqueue, self._withdraw)

    async def drain(self) -> None:
        """Wait until every request admitted so far has been answered: the queued ones get batches as
        instances free up, so this waits for them too while any instance can still take them."""
        await self._delivery.drain(lambda: bool(self._queue) and self._pool.recoverable())

    def _withdraw(self, request: PendingRequest) -> bool:
        """Take a request its client gave up on out of the queue; False when it already runs."""
        if not self._queue.remove(request):
            return False
        self.stats.pending = len(self._queue)
        return True

    def _enqueue(self, request: ScheduledRequest, reply: Reply) -> PendingRequest:
        if not self._pool.recoverable():
            raise self._no_instance()
        pending = pending_request(request, self._policy, self._sequence, self._clock.now_ns(), reply)
        try:
            self._queue.push(pending)
        except UnavailableError:
            self.stats.record_failure("REJECTED", 0)
            raise
        self._sequence += 1
        self.stats.pending = len(self._queue)
        if request.chain and request.chain[-1][0] == self._model_name:
            self._self_calls.append(pending)
        self._schedule()
        return pending

    def _no_instance(self) -> UnavailableError:
        return no_instance_error(self._model_name, self._pool)

    # -- decisions ---------------------------------------------------------------------------

    def _schedule(self) -> None:
        now = self._clock.now_ns()
        for request in self._queue.expire(now):
            self._delivery.end(request, "REJECTED", UnavailableError(TIMEOUT_EXPIRED))
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
        if self._self_calls:
            self._break_self_wait()
        if self._queue and not self._pool.recoverable():
            error = self._no_instance()
            self._delivery.fail(self._queue.pop_front(len(self._queue)), error)
        self.stats.pending = len(self._queue)
        deadline = self._queue.next_deadline()
        if deadline is not None:
            wake_at = deadline if wake_at is None else min(wake_at, deadline)
        self._alarm.set(wake_at)

    def _break_self_wait(self) -> None:
        """Every instance runs a batch that waits for a BLS call to this model queued behind it (concurrent
        requests that each call the model itself): none of those calls could ever run. The newest fails with
        the cycle's error, so its caller finishes and its instance takes the others."""
        self._self_calls = [request for request in self._self_calls if request.queued]
        if not self._self_calls or self._pool.has_free():
            return  # none left, or an instance holds no batch: it takes them
        instances = self._pool.instance_names()
        if not self_waits(self._model_name, instances, (r.request.chain for r in self._self_calls)):
            return
        newest = self._self_calls.pop()
        self._queue.remove(newest)
        model, version, _ = newest.request.chain[-1]
        where = "for a call to it queued behind it"
        self._delivery.end(newest, "OTHER", cycle_error(model, version, len(instances), newest.request.chain, where))

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

    # -- execution ---------------------------------------------------------------------------

    def _dispatch(self, batch: list[PendingRequest], now: int) -> None:
        """Hand a batch to an idle instance: each input as the requests' row blocks, the union of the
        outputs they asked for, and each request's own details."""
        wanted: dict[str, None] = {}
        for pending in batch:
            pending.dispatched_ns = now
            wanted.update(dict.fromkeys(pending.request.output_names))
        requests = [pending.request for pending in batch]
        inputs = {name: [request.inputs[name] for request in requests] for name in requests[0].inputs}
        infos = [RequestInfo(p.rows, p.request.output_names, p.request.request_id, p.request.parameters) for p in batch]
        if len(batch) > 1 and self._policy.ragged_inputs:
            try:
                infos = _flatten_ragged(inputs, infos, self._policy.ragged_inputs)
            except Exception as error:  # never leave a popped batch unanswered
                self._delivery.fail(batch, error)
                return
        streams, unary = answer_routes(batch)
        chain = merge_chains(request.chain for request in requests)
        run = self._pool.dispatch(Batch(inputs, tuple(wanted), infos, streams, unary, chain))
        self._delivery.start(run, batch, now)


def _flatten_ragged(
    inputs: dict[str, list[SharedTensor]], infos: list[RequestInfo], ragged: frozenset[str]
) -> list[RequestInfo]:
    """Ragged inputs travel flattened, one request's elements after another's (their dims differ, so they
    cannot be stacked); each request's info carries its own shapes, which the worker restores."""
    names = [name for name in inputs if name in ragged]
    shapes = [tuple((name, tuple(inputs[name][index].shape)) for name in names) for index in range(len(infos))]
    for name in names:
        inputs[name] = [part.reshaped((part.size,)) for part in inputs[name]]
    return [info._replace(ragged_shapes=own) for info, own in zip(infos, shapes, strict=True)]


def no_instance_error(model_name: str, instances: Instances) -> UnavailableError:
    """Why no instance can take the model's requests: all passive, or none running."""
    if instances.passive_only:
        return UnavailableError(
            f"model '{model_name}' has no instance that takes requests: every instance group is passive"
        )
    return UnavailableError(f"model '{model_name}' has no running instance")
