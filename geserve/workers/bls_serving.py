"""BLS in the front-end: a worker's BlsCalls run as requests, its ControlCalls on the model repository."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Protocol

import numpy as np

from geserve import log_records
from geserve.codecs import dtypes
from geserve.errors import (
    CancelledError,
    GeserveError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
)
from geserve.residency import SharedTensor
from geserve.types import CallChain, InferInput, InferRequest, RequestedOutput, response_parameters
from geserve.workers.messages import BlsCall, BlsCancel, BlsReply, ControlCall, ControlReply
from geserve.workers.runs import RunId
from geserve.workers.shm import take_tensors, write_tensors
from geserve.workers.streams import StreamItem

logger = logging.getLogger(__name__)
# Triton's text for a request whose timeout ran out.
TIMEOUT_EXPIRED = "Request timeout expired"
# What a decoupled BLS call its caller cancelled ends with, when its callee has not ended it first.
CANCELLED = "Request was cancelled"


class ModelCaller(Protocol):
    """The server as a BLS request reaches it (core's InferenceService): validated and scheduled like a
    client's request, answered with the outputs' arrays."""

    async def call_model(self, request: InferRequest, chain: CallChain = ()) -> dict[str, SharedTensor]: ...

    def stream_model(self, request: InferRequest, chain: CallChain = ()) -> AsyncIterator[StreamItem]: ...

    async def load_model(self, name: str, parameters: Mapping[str, Any] | None = None) -> None: ...

    async def unload_model(self, name: str, unload_dependents: bool = False, wait: bool = True) -> None: ...

    async def model_ready(self, name: str, version: str = "") -> bool: ...


async def serve_call(
    caller: ModelCaller | None, call: BlsCall, reply: Callable[[BlsReply], None], run: RunId, chain: CallChain = ()
) -> None:
    """Run one BlsCall, part of `chain` (the instances waiting for it), and answer it through `reply`: outputs in
    a fresh segment, or the error; a call with a timeout that runs out answers "Request timeout expired". Segments
    are named for `run`."""
    try:
        request = infer_request(call)
        if caller is None:
            raise UnavailableError("BLS requests cannot reach the server from this worker")
        timeout_s = call.timeout_us / 1e6 if call.timeout_us > 0 else None
        if call.decoupled:
            try:
                await asyncio.wait_for(_stream(caller, request, call.call_id, reply, run, chain=chain), timeout_s)
            except asyncio.CancelledError:  # the caller cancelled it: closing the stream cancelled the callee
                reply(BlsReply(call.call_id, (), CancelledError(CANCELLED), True))
            return
        outputs = await asyncio.wait_for(caller.call_model(request, chain), timeout_s)
        refs = write_tensors(arrays_of(outputs), run.segment_name("blsout"))
        reply(BlsReply(call.call_id, refs, None, True, response_parameters(outputs)))
    except TimeoutError:
        reply(BlsReply(call.call_id, (), UnavailableError(TIMEOUT_EXPIRED), True))
    except GeserveError as error:
        reply(BlsReply(call.call_id, (), error, True))
    except Exception as error:  # never leave a model waiting
        fields = log_records.request_fields(call.model_name, call.model_version, call.request_id)
        logger.exception("BLS request to model '%s' failed", call.model_name, extra=fields)
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
    caller: ModelCaller,
    request: InferRequest,
    call_id: int,
    reply: Callable[[BlsReply], None],
    run: RunId,
    *,
    chain: CallChain,
) -> None:
    final = False
    async for outputs, error, final in caller.stream_model(request, chain):
        refs = write_tensors(arrays_of(outputs or {}), run.segment_name("blsout"))
        reply(BlsReply(call_id, refs, error, final, response_parameters(outputs)))
    if not final:
        reply(BlsReply(call_id, (), None, True))


def arrays_of(outputs: Mapping[str, SharedTensor]) -> dict[str, np.ndarray]:
    """The outputs' arrays, as a BLS reply carries them (read here, where the call is answered)."""
    return {name: tensor.array for name, tensor in outputs.items()}


async def serve_control(caller: ModelCaller | None, call: ControlCall, reply: Callable[[ControlReply], None]) -> None:
    """Run one ControlCall on the server's repository and answer it: Triton's errors (a mode other than explicit
    refuses load and unload) go back to the model as they are."""
    try:
        if caller is None:
            raise UnavailableError("the model repository cannot be reached from this worker")
        ready = False
        if call.action == "load_model":
            parameters: dict[str, Any] = dict(call.files)
            if call.config:
                parameters["config"] = call.config
            await caller.load_model(call.model_name, parameters)
        elif call.action == "unload_model":
            # As Triton's TRITONSERVER_ServerUnloadModel: the model stops serving, its requests finish later, so
            # a model may unload itself from execute.
            await caller.unload_model(call.model_name, call.unload_dependents, wait=False)
        elif call.action == "is_model_ready":
            ready = await _ready(caller, call.model_name, call.model_version)
        else:
            raise InternalError(f"unknown model control call '{call.action}'")
        reply(ControlReply(call.call_id, ready, None))
    except GeserveError as error:
        reply(ControlReply(call.call_id, False, error))
    except Exception as error:  # never leave a model waiting
        fields = log_records.request_fields(call.model_name, call.model_version)
        logger.exception("%s of model '%s' failed", call.action, call.model_name, extra=fields)
        reply(ControlReply(call.call_id, False, InternalError(f"{type(error).__name__}: {error}")))


async def _ready(caller: ModelCaller, name: str, version: str) -> bool:
    """As Triton's TRITONSERVER_ServerModelIsReady: a model or version the server does not have is not ready,
    not an error (the health API's model ready endpoint reports those)."""
    try:
        return await caller.model_ready(name, version)
    except (InvalidArgumentError, NotFoundError, UnavailableError):
        return False


class BlsServer:
    """Serves the BLS calls of one instance's workers on the server (`caller`, asked at each call, as the
    server comes up after its first models), each answered through the reply it came with; `chain` tells, as
    a call arrives, the chain it is part of (the instance's running batch's, and the instance)."""

    def __init__(
        self, caller: Callable[[], ModelCaller | None], run: RunId, chain: Callable[[], CallChain] = tuple
    ) -> None:
        self._caller = caller
        self._run = run
        self._chain = chain
        self._tasks: set[asyncio.Task[None]] = set()  # held until done: the loop keeps only weak references
        self._streams: dict[int, asyncio.Task[None]] = {}  # decoupled calls by call id, which a BlsCancel names

    def __call__(
        self, call: BlsCall | BlsCancel | ControlCall, reply: Callable[[BlsReply | ControlReply], None]
    ) -> None:
        if isinstance(call, BlsCancel):
            streaming = self._streams.get(call.call_id)
            if streaming is not None:
                # After the call's first step (queued when it came, before this): a task cancelled before it starts
                # never runs, and would leave the call's input segment behind.
                asyncio.get_running_loop().call_soon(streaming.cancel)
            return
        if isinstance(call, ControlCall):
            work = serve_control(self._caller(), call, reply)
        else:
            work = serve_call(self._caller(), call, reply, self._run, self._chain())
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if isinstance(call, BlsCall) and call.decoupled:
            self._streams[call.call_id] = task
            task.add_done_callback(functools.partial(self._ended, call.call_id))

    def _ended(self, call_id: int, task: asyncio.Task[None]) -> None:
        if self._streams.get(call_id) is task:
            del self._streams[call_id]
