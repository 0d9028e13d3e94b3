"""BLS in the worker: a python model's `InferenceRequest.exec` sent to the front-end, tensors in shared memory."""

from __future__ import annotations

import contextlib
import itertools
import json
import queue
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from geserve.backends.python import pb_utils
from geserve.workers.messages import BlsCall, BlsCancel, BlsReply, ControlCall, ControlReply
from geserve.workers.runs import RunId
from geserve.workers.shm import take_tensors, unlink_quietly, write_tensors


class BlsClient:
    """Sends BlsCalls through `send` and hands each model thread waiting in `exec` the replies to its call,
    which the worker's reader thread passes to `deliver`."""

    def __init__(self, send: Callable[[object], None], run: RunId) -> None:
        self._send = send
        self._run = run  # whose id the names of the calls' segments carry
        self._ids = itertools.count()
        self._waiting: dict[int, queue.SimpleQueue[Any]] = {}  # BlsReply or ControlReply; None: the end
        # Re-entrant: a dropped ResponseIterator closes itself (and takes it) from whatever thread collects it.
        self._lock = threading.RLock()
        # The model this worker is loading, until its initialize returns: loading or unloading it from there
        # would wait for its own load.
        self.loading = ""

    def deliver(self, reply: BlsReply | ControlReply) -> None:
        with self._lock:  # queued under the lock: once `_forget` has run, nothing more lands in a forgotten queue
            waiting = self._waiting.get(reply.call_id)
            if waiting is not None:
                waiting.put(reply)
                return
        if isinstance(reply, BlsReply):  # a call the model stopped listening to
            _discard(reply)

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
            return ResponseIterator(self, call_id, replies)
        try:
            return _response(self._next(replies))
        finally:
            self._forget(call_id)

    def control(self, action: str, model_name: str, arguments: Mapping[str, Any]) -> bool:
        """`load_model`, `unload_model` or `is_model_ready`: sent to the server's repository, waited for; raises
        TritonModelException with the server's message when it fails."""
        if action != "is_model_ready" and model_name == self.loading:
            raise pb_utils.TritonModelException(
                f"model '{model_name}' cannot be loaded or unloaded from its own initialize: that waits for "
                "the load it is part of"
            )
        call_id = next(self._ids)
        replies: queue.SimpleQueue[ControlReply | None] = queue.SimpleQueue()
        with self._lock:
            self._waiting[call_id] = replies
        try:
            self._send(
                ControlCall(
                    call_id,
                    action,
                    model_name,
                    str(arguments.get("model_version", "")),
                    str(arguments.get("config", "")),
                    dict(arguments.get("files") or {}),
                    bool(arguments.get("unload_dependents", False)),
                )
            )
            reply = replies.get()
        finally:
            self._forget(call_id)
        if reply is None:
            raise pb_utils.TritonModelException("the server went away")
        if reply.error is not None:
            raise pb_utils.TritonModelException(reply.error.message)
        return reply.ready

    @staticmethod
    def _next(replies: queue.SimpleQueue[BlsReply | None]) -> BlsReply:
        reply = replies.get()
        if reply is None:
            raise pb_utils.TritonModelException("the server went away during a BLS request")
        return reply

    def cancel(self, call_id: int) -> None:
        """Ask the server to cancel a decoupled call: its callee sees `is_cancelled()`, and the call ends."""
        with contextlib.suppress(OSError, ValueError):  # the front-end is gone: so is the call
            self._send(BlsCancel(call_id))

    def _forget(self, call_id: int) -> None:
        """No more replies for this call reach its queue: later ones are discarded as they arrive."""
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


class ResponseIterator(Iterator[Any]):
    """The responses of a decoupled BLS call, read in order, as Triton's ResponseIterator. `cancel()` cancels the
    callee's request (its `is_cancelled()` turns true) and the responses still to come end with the final one.
    Once the model lets go of it (drops it, read or not; a loop it broke out of, once no name holds it any more)
    or calls `close()`, an unfinished call is cancelled, and the replies already queued and those still to come
    are discarded, their segments unlinked, so an abandoned stream leaves no shared memory behind."""

    def __init__(self, client: BlsClient, call_id: int, replies: queue.SimpleQueue[BlsReply | None]) -> None:
        self._client = client
        self._call_id = call_id
        self._replies = replies
        self._done = False  # no more to read
        self._ended = False  # the final reply came

    def __iter__(self) -> ResponseIterator:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        try:
            reply = self._client._next(self._replies)
        except BaseException:
            self.close()
            raise
        if reply.final:
            self._ended = True
            self.close()
        return _response(reply)

    def cancel(self) -> None:
        """Cancel the callee's request, as Triton's `ResponseIterator.cancel()`; the responses before its end can
        still be read."""
        if not self._ended:
            self._client.cancel(self._call_id)

    def close(self) -> None:
        if self._done:
            return
        self._done = True
        if not self._ended:
            self._client.cancel(self._call_id)
        self._client._forget(self._call_id)
        while True:  # what arrived before `_forget` and was not read
            try:
                reply = self._replies.get_nowait()
            except queue.Empty:
                return
            if reply is not None:
                _discard(reply)

    def __del__(self) -> None:
        self.close()


def _discard(reply: BlsReply) -> None:
    for name in {ref.segment for ref in reply.outputs}:
        unlink_quietly(name)


def _response(reply: BlsReply) -> Any:
    if reply.error is not None:
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(reply.error.message))
    outputs = take_tensors(reply.outputs)
    tensors = [pb_utils.Tensor(name, array) for name, array in outputs.items()]
    return pb_utils.InferenceResponse(tensors, parameters=dict(reply.parameters))


def connect(send: Callable[[object], None], run: RunId) -> BlsClient:
    """A BlsClient sending through `send`, made the one that python models' `exec` calls in this process;
    its calls' segments are named for `run`."""
    client = BlsClient(send, run)
    pb_utils.set_bls_caller(client.call, client.control)
    return client
