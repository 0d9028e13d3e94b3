"""Triton's generate extension over bare ASGI: one JSON answer, or one Server-Sent Event per response."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from typing import Any

from geserve.core.api import InferenceAPI
from geserve.errors import InvalidArgumentError
from geserve.http import generate_codec
from geserve.http.body import ClientDisconnectedError, read_body
from geserve.http.errors import error_body, failure
from geserve.http.infer import json_too_large, send_response, with_trace_context
from geserve.offload import COPY_BYTES, off_loop
from geserve.settings import DEFAULT_MAX_JSON_SIZE
from geserve.types import InferRequest, ModelMetadata, StreamedResponse, TraceMark, TraceRecord

# Triton's model route, generate actions; numeric versions only, as for infer.
GENERATE_PATH = re.compile(r"^/v2/models/([^/]+)(?:/versions/([0-9]+))?/(generate|generate_stream)$")
EVENT_STREAM = (b"content-type", b"text/event-stream; charset=utf-8")
# Triton's texts: its generate endpoint decompresses nothing, and answers one response only.
ENCODING_REFUSAL = "Unsupported content-encoding, only 'identity' is supported."
NOT_ONE_RESPONSE = (
    "generate expects model to produce exactly 1 response, use generate stream for model that generates "
    "various number of responses"
)


class GenerateEndpoint:
    """POST /v2/models/<m>[/versions/<v>]/generate[_stream], for any model, decoupled or not."""

    def __init__(self, service: InferenceAPI, max_input_size: int, max_json_size: int = DEFAULT_MAX_JSON_SIZE) -> None:
        self._service = service
        self._limit = max_input_size
        self._json_limit = max_json_size

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any, match: re.Match[str]) -> None:
        if scope["method"] != "POST":
            await send_response(send, 405, error_body("Method Not Allowed"))
            return
        received_ns = time.monotonic_ns()
        model_name, version, streaming = match.group(1), match.group(2) or "", match.group(3) == "generate_stream"
        serving = f"generate for model '{model_name}'"
        try:
            request = await self._request(scope, receive, model_name, version)
        except ClientDisconnectedError:
            return
        except Exception as error:
            await send_response(send, *failure(error, serving))
            return
        before = (("HTTP_RECV_START", received_ns), ("HTTP_RECV_END", time.monotonic_ns()))
        reply = _Reply(self._service, send, streaming, serving, before)
        answering = asyncio.ensure_future(reply.run(self._service.infer_stream(request)))
        watching = asyncio.ensure_future(_client_gone(receive))
        try:
            done, _ = await asyncio.wait((answering, watching), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watching.cancel()
            answering.cancel()  # the client went away (or this handler was cancelled): so is the request
        if answering not in done:
            await asyncio.wait((answering,))  # the cancelled request unwinds: its stream closes where it runs
            return
        answering.result()

    async def _request(self, scope: dict[str, Any], receive: Any, model_name: str, version: str) -> InferRequest:
        headers = {key: value for key, value in scope["headers"]}
        declared = headers.get(b"content-length")
        body = await read_body(receive, declared.decode("latin-1") if declared is not None else None, self._limit)
        if len(body) > self._json_limit:
            raise json_too_large(len(body), self._json_limit)
        metadata = await self._service.model_metadata(model_name, version)
        if headers.get(b"content-encoding", b"identity").strip().lower() not in (b"", b"identity"):
            raise InvalidArgumentError(ENCODING_REFUSAL)
        # Parsing and checking every value grows with the body: large ones leave the loop.
        request = await off_loop(len(body), COPY_BYTES, _decode, body, metadata, version)
        return with_trace_context(request, headers)


def _decode(body: bytes, metadata: ModelMetadata, version: str) -> InferRequest:
    return generate_codec.decode_request(generate_codec.parse(body), metadata, version)


async def _client_gone(receive: Any) -> None:
    """Returns once the client has closed its connection (the whole body is read: nothing else comes)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class _Reply:
    """One generate answer as it leaves: the status is the first response's, as in Triton (whose answer
    starts with it); an error before any response is an ordinary JSON error."""

    def __init__(
        self, service: InferenceAPI, send: Any, streaming: bool, serving: str, before: tuple[TraceMark, ...]
    ) -> None:
        self._service = service
        self._send = send
        self._streaming = streaming
        self._serving = serving
        self._before = before
        self._status: int | None = None  # set by the first response
        self._started = False  # the event stream's head is sent
        self._traces: list[tuple[TraceRecord, int]] = []

    async def run(self, responses: AsyncIterator[StreamedResponse]) -> None:
        try:
            if self._streaming:
                await self._stream(responses)
            else:
                await self._collect(responses)
        finally:
            close = getattr(responses, "aclose", None)  # a stream left early: cancelled where it runs
            if close is not None:
                await close()

    async def _entries(self, item: StreamedResponse) -> list[bytes]:
        """The bodies one item of the stream adds (an error, a response, or nothing for a bare FINAL); the
        first item sets the status."""
        entries: list[bytes] = []
        status = 200
        if item.error is not None:
            status, body = failure(item.error, self._serving)
            entries.append(body)
        if item.response is not None:
            try:
                size = sum(tensor.data.nbytes for tensor in item.response.outputs)
                entries.append(await off_loop(size, COPY_BYTES, generate_codec.encode_response, item.response))
            except Exception as error:
                error_status, body = failure(error, self._serving)
                status = status if item.error is not None else error_status
                entries.append(body)
            if item.response.trace is not None:
                self._traces.append((item.response.trace, time.monotonic_ns()))
        if self._status is None:
            self._status = status
        return entries

    async def _stream(self, responses: AsyncIterator[StreamedResponse]) -> None:
        try:
            async for item in responses:
                entries = await self._entries(item)
                await self._start_events()
                for body in entries:
                    await self._event(body)
        except Exception as error:
            status, body = failure(error, self._serving)
            if self._status is None:
                await send_response(self._send, status, body)
                return
            await self._event(body)
        if self._status is None:  # a stream that ended with no item at all: an empty 200, as Triton's
            self._status = 200
        await self._start_events()
        await self._send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _start_events(self) -> None:
        if self._status is not None and not self._started:
            self._started = True
            await self._send({"type": "http.response.start", "status": self._status, "headers": [EVENT_STREAM]})

    async def _event(self, body: bytes) -> None:
        started_ns = time.monotonic_ns()
        await self._send({"type": "http.response.body", "body": b"data: " + body + b"\n\n", "more_body": True})
        await self._record(started_ns)

    async def _collect(self, responses: AsyncIterator[StreamedResponse]) -> None:
        bodies: list[bytes] = []
        try:
            async for item in responses:
                bodies.extend(await self._entries(item))
        except Exception as error:
            status, body = failure(error, self._serving)
            if self._status is None:
                await send_response(self._send, status, body)
                return
            bodies.append(body)
        started_ns = time.monotonic_ns()
        # As Triton: the status stays the first response's even when the body says there was not one.
        await send_response(
            self._send, self._status or 200, bodies[0] if len(bodies) == 1 else error_body(NOT_ONE_RESPONSE)
        )
        await self._record(started_ns)

    async def _record(self, started_ns: int) -> None:
        """The traces of the responses just sent, with the front-end's moments, go to be written."""
        traces, self._traces = self._traces, []
        ended_ns = time.monotonic_ns()
        for trace, complete_ns in traces:
            after = (("INFER_RESPONSE_COMPLETE", complete_ns), ("HTTP_SEND_START", started_ns))
            await self._service.record_trace(trace.around(self._before, (*after, ("HTTP_SEND_END", ended_ns))))
