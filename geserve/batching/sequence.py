"""The sequence batcher: each live sequence pinned to a slot of one instance, fed Triton's control tensors."""

from __future__ import annotations

import functools
import heapq
import logging
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from geserve import log_records
from geserve.batching.clock import Alarm, Clock, LoopClock
from geserve.batching.delivery import Delivery, Done, StatsRecorder
from geserve.batching.lifecycle import InstanceControl
from geserve.batching.ordering import ResponseOrder
from geserve.batching.policy import BatchingPolicy
from geserve.batching.queue import PendingRequest, Reply, answer_routes, pending_request
from geserve.batching.request import ScheduledRequest, ScheduledResponse
from geserve.batching.scheduler import Instances, no_instance_error
from geserve.errors import InternalError, InvalidArgumentError, UnavailableError
from geserve.repository.sequence import SequenceSettings
from geserve.residency import SharedTensor
from geserve.types import EMPTY_PARAMETERS, Parameters, merge_chains
from geserve.workers.batch import Batch
from geserve.workers.messages import SEQUENCE_END, SEQUENCE_READY, SEQUENCE_START, BatchResult, RequestInfo
from geserve.workers.streams import StreamItem

logger = logging.getLogger(__name__)

CorrelationId = int | str
# Sequences lost with their instance, remembered so that their next request hears why (oldest forgotten first).
_LOST_REMEMBERED = 4096


class SequenceInstances(Instances, InstanceControl, Protocol):
    """The pool as the sequence batcher drives it, one instance at a time, and as its version's lifecycle
    controls it (workers.pool.InstancePool)."""

    @property
    def size(self) -> int: ...

    def instance_alive(self, index: int) -> bool: ...

    def incarnation(self, index: int) -> int: ...

    def idle_on(self, index: int) -> bool: ...

    def dispatch_to(self, index: int, batch: Batch) -> Coroutine[Any, Any, BatchResult]: ...


@dataclass(eq=False, slots=True)
class _Sequence:
    """One live sequence: its queued requests and the slot it holds (or waits for, in the backlog)."""

    correlation_id: CorrelationId
    requests: deque[PendingRequest] = field(default_factory=deque)
    instance: int = -1  # -1: in the backlog, or released
    slot: int = -1
    incarnation: int = 0
    running: bool = False  # one of its requests is in a batch now
    # When its idle clock last restarted: it got its slot, a request arrived, or its last request ran.
    last_ns: int = 0


# One row of a batch: the slot, and the request in it (None: the padding of an empty slot).
_Row = tuple[int, PendingRequest | None]


class SequenceScheduler:
    """Triton's sequence batcher over a model version's instances.

    - A request names its sequence (`sequence_id`) and its first and last request say so
      (`sequence_start`, `sequence_end`). A new sequence takes a free slot (lowest slot first, spread across
      instances) or waits in the backlog, in arrival order, until one frees up.
    - Each instance has `max_batch_size` slots (1 without batching), or `max_candidate_sequences` with the
      oldest strategy. A sequence's requests run in order on its instance, one at a time, and its implicit
      state stays in that instance's worker.
    - direct: a batch has one row per slot up to the highest slot with a request ready; empty slots are
      padding with READY false. oldest: a batch takes the oldest ready request of up to `max_batch_size`
      sequences, formed like the dynamic batcher's (preferred sizes, max_queue_delay_microseconds).
    - oldest with `preserve_ordering`: each instance answers in the order its requests were dispatched to it
      (Triton's per-instance dynamic batcher order); a decoupled request's responses wait in its stream.
    - A slot is freed when its sequence's END request has run, or after `max_sequence_idle_microseconds`
      idle: nothing queued or running since it took its slot, its last request arrived or its last one ran
      (time waiting in the backlog does not count); a sequence whose instance died is lost, its queued requests fail.
    """

    def __init__(
        self,
        model_name: str,
        pool: SequenceInstances,
        settings: SequenceSettings,
        stats: StatsRecorder,
        clock: Clock | None = None,
    ) -> None:
        self._model_name = model_name
        self._instances = pool
        pool.on_idle = self._schedule
        self._settings = settings
        # Requests have no priority levels or queue timeouts here; the policy only tells a batch's rows.
        self._policy = BatchingPolicy(max_batch_size=settings.max_batch_size)
        self.stats = stats
        self._clock = clock or LoopClock()
        self._sequence = 0  # requests admitted so far
        self._alarm = Alarm(self._clock, self._schedule)
        self._delivery = Delivery(model_name, stats, self._clock, self._schedule)
        self._live: dict[CorrelationId, _Sequence] = {}  # by id; a sequence whose END is queued has left
        self._owner: dict[PendingRequest, _Sequence] = {}  # queued requests
        self._slots: list[list[_Sequence | None]] = [[None] * settings.slots_per_instance for _ in range(pool.size)]
        self._free = [(slot, index) for index in range(pool.size) for slot in range(settings.slots_per_instance)]
        heapq.heapify(self._free)
        self._parked: list[tuple[int, int]] = []  # free slots of instances that are down
        self._backlog: deque[_Sequence] = deque()
        self._lost: OrderedDict[CorrelationId, str] = OrderedDict()
        self._queued = 0
        # oldest with preserve_ordering: each instance's answers in the order its requests were dispatched.
        self._orders = [ResponseOrder() for _ in range(pool.size)] if settings.preserve_ordering else None

    async def execute(self, request: ScheduledRequest) -> ScheduledResponse:
        """Queue one request of a sequence and wait for its outputs and the timestamps of its batch."""
        return await self._delivery.execute(request, self._enqueue, self._withdraw)

    def submit(self, request: ScheduledRequest, done: Done) -> PendingRequest:
        """Queue one request whose outcome (outputs or error) goes to `done`; returns it, for `cancel`."""
        return self._delivery.submit(request, self._enqueue, done)

    def cancel(self, pending: PendingRequest) -> None:
        """A submitted request's client went away."""
        self._delivery.cancel(pending, self._withdraw)

    def stream(self, request: ScheduledRequest) -> AsyncIterator[StreamItem]:
        """Queue one request of a decoupled sequence model (when iterated) and yield its responses."""
        return self._delivery.stream(request, self._enqueue, self._withdraw)

    async def drain(self) -> None:
        """Wait until every request admitted so far has been answered (while an instance can take them)."""
        await self._delivery.drain(lambda: self._queued > 0 and self._instances.recoverable())

    # -- admission ---------------------------------------------------------------------------

    def _enqueue(self, request: ScheduledRequest, reply: Reply) -> PendingRequest:
        try:
            correlation_id, start, end = self._check(request.inputs, request.parameters)
        except (InvalidArgumentError, UnavailableError):
            self.stats.record_failure("OTHER", 0)
            raise
        now = self._clock.now_ns()
        sequence = self._live.get(correlation_id)
        if sequence is None:
            sequence = _Sequence(correlation_id)
            self._live[correlation_id] = sequence
            self._lost.pop(correlation_id, None)
            self._take_slot(sequence)
        elif start:
            logger.warning(
                "sequence %s for model '%s' has a conflict. The previous sequence did not end before this sequence "
                "start. Previous sequence will be terminated early.",
                correlation_id,
                self._model_name,
                extra=log_records.request_fields(self._model_name, request_id=request.request_id),
            )
        pending = pending_request(request, self._policy, self._sequence, now, reply)
        self._sequence += 1
        sequence.requests.append(pending)
        sequence.last_ns = now
        self._owner[pending] = sequence
        self._queued += 1
        if end:
            # Later requests with this id start a new sequence; this one's slot is freed once END has run.
            del self._live[correlation_id]
        self._schedule()
        return pending

    def _check(self, inputs: Mapping[str, SharedTensor], parameters: Parameters) -> tuple[CorrelationId, bool, bool]:
        """The request's sequence id and flags, or Triton's error for a request the batcher cannot take."""
        name = self._model_name
        if not self._instances.recoverable():
            raise no_instance_error(name, self._instances)
        if self._settings.batched:
            first = next(iter(inputs.values()), None)
            if first is not None and first.ndim and first.shape[0] != 1:
                raise InvalidArgumentError(
                    f"inference request to model '{name}' must specify batch-size 1 due to requirements of "
                    "sequence batcher"
                )
        correlation_id = parameters.get("sequence_id", 0)
        if not isinstance(correlation_id, int | str) or isinstance(correlation_id, bool) or correlation_id in (0, ""):
            raise InvalidArgumentError(
                f"inference request to model '{name}' must specify a non-zero or non-empty correlation ID"
            )
        if isinstance(correlation_id, int) and not 0 < correlation_id < 1 << 64:
            raise InvalidArgumentError(
                f"inference request to model '{name}' has sequence_id {correlation_id}: a numeric sequence id must be "
                "an unsigned 64-bit integer"
            )
        control = self._settings.correlation
        if control is not None and not control.accepts(correlation_id):
            given = "BYTES" if isinstance(correlation_id, str) else "UINT64"
            raise InvalidArgumentError(
                f"sequence batching control 'CORRID' data-type is '{given}', but model '{name}' expects "
                f"'{control.datatype.wire}'"
            )
        if control is not None and isinstance(correlation_id, int) and not control.holds(correlation_id):
            raise InvalidArgumentError(
                f"sequence id {correlation_id} does not fit the '{control.datatype.wire}' CORRID control of model "
                f"'{name}'"
            )
        start, end = parameters.get("sequence_start") is True, parameters.get("sequence_end") is True
        if correlation_id not in self._live and not start:
            lost = self._lost.pop(correlation_id, None)
            if lost is not None:
                raise UnavailableError(lost)
            raise InvalidArgumentError(
                f"inference request for sequence {correlation_id} to model '{name}' must specify the START flag on "
                "the first request of the sequence"
            )
        return correlation_id, start, end

    def _withdraw(self, request: PendingRequest) -> bool:
        sequence = self._owner.pop(request, None)
        if sequence is None:
            return False
        sequence.requests.remove(request)
        self._queued -= 1
        self.stats.pending = self._queued
        return True

    # -- slots -------------------------------------------------------------------------------

    def _take_slot(self, sequence: _Sequence) -> None:
        """A free slot on a running instance, else the back of the backlog."""
        while self._free:
            slot, index = heapq.heappop(self._free)
            if not self._instances.instance_alive(index):
                self._parked.append((slot, index))
                continue
            sequence.instance, sequence.slot = index, slot
            sequence.incarnation = self._instances.incarnation(index)
            self._slots[index][slot] = sequence
            # Time in the backlog is not idle time (Triton's reaper skips backlogged ids too): the clock starts here.
            sequence.last_ns = self._clock.now_ns()
            return
        self._backlog.append(sequence)

    def _free_slot(self, sequence: _Sequence) -> None:
        """The sequence leaves its slot; the first sequence of the backlog takes a slot."""
        index, slot = sequence.instance, sequence.slot
        if index < 0 or self._slots[index][slot] is not sequence:
            return
        self._slots[index][slot] = None
        sequence.instance = sequence.slot = -1
        heapq.heappush(self._free, (slot, index))
        if self._backlog:
            self._take_slot(self._backlog.popleft())

    def _unpark(self) -> None:
        back = [entry for entry in self._parked if self._instances.instance_alive(entry[1])]
        if back:
            self._parked = [entry for entry in self._parked if entry not in back]
            for entry in back:
                heapq.heappush(self._free, entry)
            while self._backlog and self._free:
                self._take_slot(self._backlog.popleft())

    def _drop_lost(self) -> None:
        """Sequences whose instance died (or was replaced) lost their state: they end here, with an error."""
        for index, slots in enumerate(self._slots):
            alive = self._instances.instance_alive(index)
            incarnation = self._instances.incarnation(index) if alive else -1
            for sequence in slots:
                if sequence is not None and sequence.incarnation != incarnation:
                    self._lose(sequence)

    def _lose(self, sequence: _Sequence) -> None:
        message = (
            f"sequence {sequence.correlation_id} of model '{self._model_name}' was lost: the instance that held its "
            "state stopped; start the sequence again"
        )
        logger.warning("%s", message, extra=log_records.request_fields(self._model_name))
        failed = list(sequence.requests)
        if self._live.get(sequence.correlation_id) is sequence:
            del self._live[sequence.correlation_id]
            if not failed:  # else the client hears it from those requests
                self._lost[sequence.correlation_id] = message
                while len(self._lost) > _LOST_REMEMBERED:
                    self._lost.popitem(last=False)
        sequence.requests.clear()
        for request in failed:
            del self._owner[request]
        self._queued -= len(failed)
        self._delivery.fail(failed, UnavailableError(message))
        index, slot = sequence.instance, sequence.slot
        self._slots[index][slot] = None
        sequence.instance = sequence.slot = -1
        self._parked.append((slot, index))

    def _reap(self, now: int) -> int | None:
        """Free the slots of sequences idle for max_sequence_idle_microseconds; when the next one falls due."""
        idle_ns = self._settings.idle_ns
        due: int | None = None
        for slots in self._slots:
            for sequence in slots:
                if sequence is None or sequence.requests or sequence.running:
                    continue
                expires = sequence.last_ns + idle_ns
                if now >= expires:
                    logger.info(
                        "sequence %s of model '%s' was idle for %d us: its slot is freed",
                        sequence.correlation_id,
                        self._model_name,
                        idle_ns // 1000,
                        extra=log_records.request_fields(self._model_name),
                    )
                    if self._live.get(sequence.correlation_id) is sequence:
                        del self._live[sequence.correlation_id]
                    self._free_slot(sequence)
                else:
                    due = expires if due is None else min(due, expires)
        return due

    # -- decisions ---------------------------------------------------------------------------

    def _schedule(self) -> None:
        now = self._clock.now_ns()
        self._unpark()
        self._drop_lost()
        wake_at = self._reap(now)
        for index in range(self._instances.size):
            while self._instances.idle_on(index):
                rows, wait_until = self._form(index, now)
                if wait_until is not None:
                    wake_at = wait_until if wake_at is None else min(wake_at, wait_until)
                if not rows:
                    break
                self._dispatch_rows(index, rows, now)
        if self._queued and not self._instances.recoverable():
            self._fail_all(no_instance_error(self._model_name, self._instances))
        self.stats.pending = self._queued
        self._alarm.set(wake_at)

    def _fail_all(self, error: UnavailableError) -> None:
        failed = list(self._owner)
        for sequence in {id(s): s for s in self._owner.values()}.values():
            sequence.requests.clear()
        self._owner.clear()
        self._queued = 0
        self._delivery.fail(failed, error)

    def _form(self, index: int, now: int) -> tuple[list[_Row], int | None]:
        """The rows of the next batch for instance `index`, or none and when to look again."""
        settings = self._settings
        slots = self._slots[index]
        ready = [(slot, s) for slot, s in enumerate(slots) if s is not None and s.requests and not s.running]
        if not ready:
            return [], None
        key = ready[0][1].requests[0].shape_key
        ready = [(slot, s) for slot, s in ready if s.requests[0].shape_key == key]
        oldest_ns = min(s.requests[0].enqueued_ns for _, s in ready)
        if settings.oldest:
            return self._form_oldest(ready, oldest_ns, now)
        underused = len(ready) < settings.minimum_slot_utilization * len(slots)
        if settings.max_delay_ns and underused and now < oldest_ns + settings.max_delay_ns:
            return [], oldest_ns + settings.max_delay_ns
        if not settings.batched:
            return [(ready[0][0], ready[0][1].requests[0])], None
        taken = {slot: s.requests[0] for slot, s in ready}
        return [(slot, taken.get(slot)) for slot in range(max(taken) + 1)], None

    def _form_oldest(
        self, ready: list[tuple[int, _Sequence]], oldest_ns: int, now: int
    ) -> tuple[list[_Row], int | None]:
        settings = self._settings
        ready.sort(key=lambda entry: entry[1].requests[0].enqueued_ns)
        limit = max(settings.max_batch_size, 1)
        count = min(len(ready), limit)
        if count < limit:
            preferred = [size for size in settings.preferred_sizes if size <= count]
            if preferred:
                count = preferred[-1]
            elif settings.max_delay_ns and now < oldest_ns + settings.max_delay_ns:
                return [], oldest_ns + settings.max_delay_ns
        return [(slot, s.requests[0]) for slot, s in ready[:count]], None

    # -- execution ---------------------------------------------------------------------------

    def _dispatch_rows(self, index: int, rows: list[_Row], now: int) -> None:
        """Send one batch to instance `index`: the requests' inputs, padding for empty slots, and the controls."""
        sequences: list[_Sequence | None] = []
        for _, request in rows:
            if request is None:
                sequences.append(None)
                continue
            sequence = self._owner.pop(request)
            sequence.requests.popleft()
            sequence.running = True
            request.dispatched_ns = now
            if self._orders is not None:
                request.turn = self._orders[index].issue()
            sequences.append(sequence)
        self._queued -= sum(1 for s in sequences if s is not None)
        try:
            run = self._send(index, rows, sequences)
        except Exception as failure:  # a batch that cannot even be built fails its requests, not the batcher
            fields = log_records.request_fields(self._model_name)
            logger.exception("model '%s': could not build a sequence batch", self._model_name, extra=fields)
            run = _failing(InternalError(f"model '{self._model_name}': {type(failure).__name__}: {failure}"))
        pending = [request for _, request in rows]
        self._delivery.start(run, pending, now, then=functools.partial(self._ran, rows, sequences))

    def _send(
        self, index: int, rows: list[_Row], sequences: list[_Sequence | None]
    ) -> Coroutine[Any, Any, BatchResult]:
        settings = self._settings
        model = next(pending.request for _, pending in rows if pending is not None)
        requests = [pending.request if pending is not None else None for _, pending in rows]
        inputs: dict[str, list[SharedTensor]] = {
            name: [request.inputs[name] if request is not None else _padding(tensor) for request in requests]
            for name, tensor in model.inputs.items()
        }
        starts = [request is not None and request.parameters.get("sequence_start") is True for request in requests]
        ends = [request is not None and request.parameters.get("sequence_end") is True for request in requests]
        batched = settings.batched
        if settings.start is not None:
            inputs[settings.start.name] = [SharedTensor.local(settings.start.array(starts, batched))]
        if settings.end is not None:
            inputs[settings.end.name] = [SharedTensor.local(settings.end.array(ends, batched))]
        if settings.ready is not None:
            ready = settings.ready.array([r is not None for r in requests], batched)
            inputs[settings.ready.name] = [SharedTensor.local(ready)]
        if settings.correlation is not None:
            ids = [s.correlation_id if s is not None else 0 for s in sequences]
            inputs[settings.correlation.name] = [SharedTensor.local(settings.correlation.array(ids, batched))]
        infos: list[RequestInfo] = []
        wanted: dict[str, None] = {}
        for (slot, pending), start, end in zip(rows, starts, ends, strict=True):
            if pending is None:
                infos.append(RequestInfo(1, (), "", EMPTY_PARAMETERS, -1, slot, 0))
                continue
            request = pending.request
            flags = SEQUENCE_READY | (SEQUENCE_START if start else 0) | (SEQUENCE_END if end else 0)
            infos.append(
                RequestInfo(pending.rows, request.output_names, request.request_id, request.parameters, -1, slot, flags)
            )
            wanted.update(dict.fromkeys(request.output_names))
        streams, unary = answer_routes(pending for _, pending in rows)
        chain = merge_chains(request.chain for request in requests if request is not None)
        return self._instances.dispatch_to(index, Batch(inputs, tuple(wanted), infos, streams, unary, chain))

    def _ran(self, rows: list[_Row], sequences: list[_Sequence | None]) -> None:
        """A batch is back: its sequences can run their next request, and those it ended free their slots."""
        for (_, pending), sequence in zip(rows, sequences, strict=True):
            if pending is None or sequence is None:
                continue
            sequence.running = False
            # Idle means no request queued or running (model_config.proto): the clock restarts as this one leaves.
            sequence.last_ns = self._clock.now_ns()
            if pending.request.parameters.get("sequence_end") is True:
                self._free_slot(sequence)


async def _failing(error: InternalError) -> BatchResult:
    raise error


def _padding(like: SharedTensor) -> SharedTensor:
    """An empty slot's input: zeros (empty strings) shaped as a real request's, made by the worker."""
    return SharedTensor.zeros(like.datatype, like.shape)
