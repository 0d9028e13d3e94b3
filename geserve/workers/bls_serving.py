"""BLS in the front-end: a worker's BlsCall run as a request of the server, answered with BlsReplies."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import numpy as np

from geserve.codecs import dtypes
from geserve.errors import GeserveError, InternalError, UnavailableError
from geserve.types import InferInput, InferRequest, RequestedOutput, response_parameters
from geserve.workers.messages import BlsCall, BlsReply
from geserve.workers.runs import RunId
from geserve.workers.shm import take_tensors, write_tensors
from geserve.workers.streams import StreamItem

logger = logging.getLogger(__name__)
# Triton's text for a request whose timeout ran out.
TIMEOUT_EXPIRED = "Request timeout expired"


class ModelCaller(Protocol):
    """The server as a BLS request reaches it (core's InferenceService): validated and scheduled like a
    client's request, answered with the outputs' arrays."""

    async def call_model(self, request: InferRequest) -> dict[str, np.ndarray]: ...

    def stream_model(self, request: InferRequest) -> AsyncIterator[StreamItem]: ...


async def serve_call(caller: ModelCaller | None, call: BlsCall, reply: Callable[[BlsReply], None], run: RunId) -> None:
    """Run one BlsCall and answer it through `reply`: outputs in a fresh segment, or the error; a call with a
    timeout that runs out answers "Request timeout expired". Segments are named for `run`."""
    try:
        request = infer_request(call)
        if caller is None:
            raise UnavailableError("BLS requests cannot reach the server from this worker")
        timeout_s = call.timeout_us / 1e6 if call.timeout_us > 0 else None
        if call.decoupled:
            await asyncio.wait_for(_stream(caller, request, call.call_id, reply, run), timeout_s)
            return
        outputs = await asyncio.wait_for(caller.call_model(request), timeout_s)
        refs = write_tensors(outputs, run.segment_name("blsout"))
        reply(BlsReply(call.call_id, refs, None, True, response_parameters(outputs)))
    except TimeoutError:
        reply(BlsReply(call.call_id, (), UnavailableError(TIMEOUT_EXPIRED), True))
    except GeserveError as error:
        reply(BlsReply(call.call_id, (), error, True))
    except Exception as error:  # never leave a model waiting
        logger.exception("BLS request to model '%s' failed", call.model_name)
        reply(BlsReply(call.call_id, (), InternalError(f"{type(error).__name__}: {error}"), True))


def infer_request(call: BlsCall) -> InferRequest:
    """The call as a client's request; its input segments are read (and unlinked) here."""
    arrays = take_tensors(call.inputs)
    return InferRequest(
        call.model_name,
        call.model_version,
        tuple(InferInput(name, dtypes.from_numpy(a.dtype).wire, tuple(a.shape), a) for name, a in arrays.items()),
        tuple(RequestedOutput(name) for name in call.output_names),
        call.request_id,
        dict(call.parameters),
    )


async def _stream(
    caller: ModelCaller, request: InferRequest, call_id: int, reply: Callable[[BlsReply], None], run: RunId
) -> None:
    final = False
    async for outputs, error, final in caller.stream_model(request):
        refs = write_tensors(outputs or {}, run.segment_name("blsout"))
        reply(BlsReply(call_id, refs, error, final, response_parameters(outputs)))
    if not final:
        reply(BlsReply(call_id, (), None, True))


class BlsServer:
    """Serves the BLS calls of one instance's workers on the server (`caller`, asked at each call, as the
    server comes up after its first models), each answered through the reply it came with."""

    def __init__(self, caller: Callable[[], ModelCaller | None], run: RunId) -> None:
        self._caller = caller
        self._run = run
        self._tasks: set[asyncio.Task[None]] = set()  # held until done: the loop keeps only weak references

    def __call__(self, call: BlsCall, reply: Callable[[BlsReply], None]) -> None:
        task = asyncio.get_running_loop().create_task(serve_call(self._caller(), call, reply, self._run))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
