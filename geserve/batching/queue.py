"""The request queue of one model version: priority levels, size limits and timeouts."""

from __future__ import annotations

import asyncio
import heapq
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from geserve.batching.ordering import Turn
from geserve.batching.policy import BatchingPolicy
from geserve.batching.request import RequestTimestamps, ScheduledRequest
from geserve.errors import CancelledError, GeserveError, UnavailableError
from geserve.residency import SharedTensor
from geserve.workers.streams import ResponseStream

QUEUE_FULL = "Exceeds maximum queue size"
TIMEOUT_EXPIRED = "Request timeout expired"


class UnaryReply:
    """Where the one response of a request goes: a future its caller awaits, or, given `done`, that callback, called
    once with the outputs or the error (no future, no task: how a submission is answered). A caller that goes away
    while the request runs `cancel`s it: the instance running it is told, and what its batch still answers is dropped
    (a callback then hears the cancellation once the batch is back)."""

    __slots__ = ("_done", "_on_cancel", "answered", "cancelled", "future")
    ends_with_batch = True  # counted as a success when its batch returns

    def __init__(self, done: Callable[[dict[str, SharedTensor] | GeserveError], None] | None = None) -> None:
        self._done = done
        self.future: asyncio.Future[dict[str, SharedTensor]] | None = (
            None if done is not None else asyncio.get_running_loop().create_future()
        )
        self.cancelled = False
        self.answered = False
        self._on_cancel: Callable[[], None] | None = None

    def on_cancel(self, callback: Callable[[], None] | None) -> None:
        """What the instance running the request does when its client goes away (workers.batch.Cancellable)."""
        if callback is not None and self.cancelled:
            callback()  # gone between its dispatch and its batch reaching the instance
            return
        self._on_cancel = callback

    def cancel(self) -> None:
        if self.cancelled:
            return
        self.cancelled = True
        callback, self._on_cancel = self._on_cancel, None
        if callback is not None:
            callback()

    def succeed(self, outputs: dict[str, SharedTensor]) -> None:
        if self.cancelled and self._done is not None:
            self._answer(CancelledError("request cancelled"))
        else:
            self._answer(outputs)

    def fail(self, error: GeserveError) -> None:
        self._answer(error)

    def _answer(self, outcome: dict[str, SharedTensor] | GeserveError) -> None:
        if self.answered:
            return
        self.answered = True
        if self._done is not None:
            self._done(outcome)
        elif self.future is not None and not self.future.done():  # else the client went away
            if isinstance(outcome, GeserveError):
                self.future.set_exception(outcome)
            else:
                self.future.set_result(outcome)


class StreamReply:
    """A request of a decoupled model: its responses come on its stream, which a failure ends."""

    ends_with_batch = False  # it ends with its final response, counted then

    def __init__(self) -> None:
        self.stream = ResponseStream()

    def succeed(self, outputs: dict[str, SharedTensor]) -> None:
        return None  # the batch ran; the responses come on the stream

    def fail(self, error: GeserveError) -> None:
        self.stream.fail(error)


# How a request is answered.
Reply = UnaryReply | StreamReply


def answer_routes(
    batch: Iterable[PendingRequest | None],
) -> tuple[dict[int, ResponseStream], dict[int, UnaryReply]]:
    """By index in a batch (None: a row of padding): the streams its decoupled requests answer on, and its
    unary requests, whose clients may go away while it runs."""
    streams: dict[int, ResponseStream] = {}
    unary: dict[int, UnaryReply] = {}
    for index, pending in enumerate(batch):
        if pending is None:
            continue
        reply = pending.reply
        if isinstance(reply, StreamReply):
            streams[index] = reply.stream
        else:
            unary[index] = reply
    return streams, unary


@dataclass(eq=False, slots=True)
class PendingRequest:
    """One request waiting for (or running in) a batch."""

    sequence: int  # its place in arrival order
    request: ScheduledRequest
    rows: int  # its share of the batch dimension
    shape_key: tuple[tuple[int, ...], ...]  # non-batch dims of non-ragged inputs; only equal keys share a batch
    level: int
    enqueued_ns: int
    deadline_ns: int | None
    reply: Reply = field(repr=False)
    queued: bool = True
    delayed: bool = False
    dispatched_ns: int = 0
    timestamps: RequestTimestamps | None = None  # once its batch has returned
    turn: Turn | None = None  # its place in its instance's response order, once dispatched (preserve_ordering)
    counted: bool = False  # its outcome is in the statistics (its answer may still wait for its turn)


def pending_request(
    request: ScheduledRequest, policy: BatchingPolicy, sequence: int, now_ns: int, reply: Reply
) -> PendingRequest:
    """A request as it waits: its rows and the dims it can share a batch on, its priority level, and when
    its queue timeout (the request's own, as the policy allows it) expires."""
    batched = policy.max_batch_size > 0
    inputs, parameters = request.inputs, request.parameters
    first = next(iter(inputs.values()), None)
    rows = int(first.shape[0]) if batched and first is not None and first.ndim else 1
    ragged = policy.ragged_inputs
    shape_key = tuple(
        () if name in ragged else tuple(array.shape[1:]) if batched else tuple(array.shape)
        for name, array in inputs.items()
    )
    priority = parameters.get("priority")
    level = policy.level(priority if isinstance(priority, int) else None)
    timeout = parameters.get("timeout")
    timeout_ns = policy.queue_policies[level - 1].timeout_ns(timeout if isinstance(timeout, int) else None)
    deadline_ns = now_ns + timeout_ns if timeout_ns else None
    return PendingRequest(sequence, request, rows, shape_key, level, now_ns, deadline_ns, reply)


class RequestQueue:
    """Levels served highest first (1 = highest), FIFO within a level; requests whose timeout
    expired with timeout_action DELAY wait behind every level."""

    def __init__(self, policy: BatchingPolicy) -> None:
        self._policy = policy
        self._levels: list[deque[PendingRequest]] = [deque() for _ in range(policy.priority_levels)]
        self._delayed: deque[PendingRequest] = deque()
        self._deadlines: list[tuple[int, int, PendingRequest]] = []
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def push(self, request: PendingRequest) -> None:
        """Queue a request; a full level refuses it with UNAVAILABLE."""
        level = self._levels[request.level - 1]
        limit = self._policy.queue_policies[request.level - 1].max_queue_size
        if limit and len(level) >= limit:
            raise UnavailableError(QUEUE_FULL)
        level.append(request)
        self._size += 1
        if request.deadline_ns is not None:
            heapq.heappush(self._deadlines, (request.deadline_ns, request.sequence, request))

    def in_order(self) -> Iterator[PendingRequest]:
        """Queued requests in the order they are served."""
        for level in self._levels:
            yield from level
        yield from self._delayed

    def pop_front(self, count: int) -> list[PendingRequest]:
        """Take the first `count` requests in service order."""
        taken: list[PendingRequest] = []
        for level in [*self._levels, self._delayed]:
            while level and len(taken) < count:
                request = level.popleft()
                request.queued = False
                taken.append(request)
        self._size -= len(taken)
        return taken

    def remove(self, request: PendingRequest) -> bool:
        """Take a request out (a cancelled client); False when it is no longer queued."""
        if not request.queued:
            return False
        queue = self._delayed if request.delayed else self._levels[request.level - 1]
        queue.remove(request)
        request.queued = False
        self._size -= 1
        return True

    def expire(self, now_ns: int) -> list[PendingRequest]:
        """Apply timeouts due by `now_ns`: REJECT ones are removed and returned, DELAY ones move back."""
        rejected = []
        while self._deadlines and self._deadlines[0][0] <= now_ns:
            _, _, request = heapq.heappop(self._deadlines)
            if not request.queued or request.delayed:
                continue
            if self._policy.queue_policies[request.level - 1].delay_on_timeout:
                self._levels[request.level - 1].remove(request)
                request.delayed = True
                self._delayed.append(request)
            else:
                self.remove(request)
                rejected.append(request)
        return rejected

    def next_deadline(self) -> int | None:
        while self._deadlines and (not self._deadlines[0][2].queued or self._deadlines[0][2].delayed):
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None
