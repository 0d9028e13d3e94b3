"""BLS in the worker: a python model's `InferenceRequest.exec` sent to the front-end, tensors in shared memory."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Protocol

import numpy as np

from geserve.backends.python import pb_utils
from geserve.codecs import dtypes
from geserve.errors import GeserveError, InternalError, UnavailableError
from geserve.types import InferInput, InferRequest, RequestedOutput
from geserve.workers.messages import BlsCall, BlsReply
from geserve.workers.runs import RunId
from geserve.workers.shm import take_tensors, unlink_quietly, write_tensors

logger = logging.getLogger(__name__)
# Triton's text for a request whose timeout ran out.
TIMEOUT_EXPIRED = "Request timeout expired"


class BlsClient:
    """Sends BlsCalls through `send` and hands each model thread waiting in `exec` the replies to its call,
    which the worker's reader thread passes to `deliver`."""

    def __init__(self, send: Callable[[object], None], run: RunId) -> None:
        self._send = send
        self._run = run  # whose id the names of the calls' segments carry
        self._ids = itertools.count()
        self._waiting: dict[int, queue.SimpleQueue[BlsReply | None]] = {}
        self._lock = threading.Lock()

    def deliver(self, reply: BlsReply) -> None:
        with self._lock:
            waiting = self._waiting.get(reply.call_id)
        if waiting is not None:
            waiting.put(reply)
            return
        for name in {ref.segment for ref in reply.outputs}:  # a call the model stopped listening to
            unlink_quietly(name)

    def close(self) -> None:
        """The front-end is gone: every waiting call ends."""
        with self._lock:
            waiting = list(self._waiting.values())
        for replies in waiting:
            replies.put(None)

    def call(self, request: pb_utils.InferenceRequest, decoupled: bool) -> Any:
        """`exec`: one InferenceResponse, or with `decoupled` an iterator of them (the last one final)."""
        call_id = next(self._ids)
        replies: queue.SimpleQueue[BlsReply | None] = queue.SimpleQueue()
        with self._lock:
            self._waiting[call_id] = replies
        try:
            self._send(self._message(call_id, request, decoupled))
        except BaseException:
            self._forget(call_id)
            raise
        if decoupled:
            return self._responses(call_id, replies)
        try:
            return _response(self._next(replies))
        finally:
            self._forget(call_id)

    def _responses(self, call_id: int, replies: queue.SimpleQueue[BlsReply | None]) -> Iterator[Any]:
        try:
            while True:
                reply = self._next(replies)
                yield _response(reply)
                if reply.final:
                    return
        finally:
            self._forget(call_id)

    @staticmethod
    def _next(replies: queue.SimpleQueue[BlsReply | None]) -> BlsReply:
        reply = replies.get()
        if reply is None:
            raise pb_utils.TritonModelException("the server went away during a BLS request")
        return reply

    def _forget(self, call_id: int) -> None:
        with self._lock:
            self._waiting.pop(call_id, None)

    def _message(self, call_id: int, request: pb_utils.InferenceRequest, decoupled: bool) -> BlsCall:
        arrays = {tensor.name(): tensor.as_numpy() for tensor in request.inputs()}
        parameters: dict[str, bool | int | float | str] = {}
        try:
            given = json.loads(request.parameters() or "{}")
        except ValueError:
            given = {}
        if isinstance(given, dict):
            parameters.update({k: v for k, v in given.items() if isinstance(v, bool | int | str)})
        correlation = request.correlation_id()
        if correlation not in (0, ""):
            parameters["sequence_id"] = correlation
            parameters["sequence_start"] = bool(request.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START)
            parameters["sequence_end"] = bool(request.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END)
        version = request.model_version()
        return BlsCall(
            call_id,
            request.model_name(),
            str(version) if version >= 0 else "",
            write_tensors(arrays, self._run.segment_name("bls")),
            tuple(request.requested_output_names()),
            request.request_id(),
            parameters,
            int(request.timeout()),
            decoupled,
        )


def _response(reply: BlsReply) -> Any:
    if reply.error is not None:
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(reply.error.message))
    outputs = take_tensors(reply.outputs)
    return pb_utils.InferenceResponse([pb_utils.Tensor(name, array) for name, array in outputs.items()])


# -- the front-end's side ---------------------------------------------------------------------------------

StreamItem = tuple[dict[str, np.ndarray] | None, GeserveError | None, bool]


class ModelCaller(Protocol):
    """The server as a BLS request reaches it (core's InferenceService): validated and scheduled like a
    client's request, answered with the outputs' arrays."""

    async def call_model(self, request: InferRequest) -> dict[str, np.ndarray]: ...

    def stream_model(self, request: InferRequest) -> AsyncIterator[StreamItem]: ...


async def serve_call(caller: ModelCaller | None, call: BlsCall, reply: Callable[[BlsReply], None], run: RunId) -> None:
    """Run one BlsCall and answer it through `reply`: outputs in a fresh segment, or the error; a call with a
    timeout that runs out answers "Request timeout expired". Segments are named for `run`."""
    try:
        arrays = take_tensors(call.inputs)
        if caller is None:
            raise UnavailableError("BLS requests cannot reach the server from this worker")
        request = InferRequest(
            call.model_name,
            call.model_version,
            tuple(InferInput(name, dtypes.from_numpy(a.dtype).wire, tuple(a.shape), a) for name, a in arrays.items()),
            tuple(RequestedOutput(name) for name in call.output_names),
            call.request_id,
            dict(call.parameters),
        )
        timeout_s = call.timeout_us / 1e6 if call.timeout_us > 0 else None
        if call.decoupled:
            await asyncio.wait_for(_stream(caller, request, call.call_id, reply, run), timeout_s)
            return
        outputs = await asyncio.wait_for(caller.call_model(request), timeout_s)
        reply(BlsReply(call.call_id, write_tensors(outputs, run.segment_name("blsout")), None, True))
    except TimeoutError:
        reply(BlsReply(call.call_id, (), UnavailableError(TIMEOUT_EXPIRED), True))
    except GeserveError as error:
        reply(BlsReply(call.call_id, (), error, True))
    except Exception as error:  # never leave a model waiting
        logger.exception("BLS request to model '%s' failed", call.model_name)
        reply(BlsReply(call.call_id, (), InternalError(f"{type(error).__name__}: {error}"), True))


async def _stream(
    caller: ModelCaller, request: InferRequest, call_id: int, reply: Callable[[BlsReply], None], run: RunId
) -> None:
    final = False
    async for outputs, error, final in caller.stream_model(request):
        reply(BlsReply(call_id, write_tensors(outputs or {}, run.segment_name("blsout")), error, final))
    if not final:
        reply(BlsReply(call_id, (), None, True))
