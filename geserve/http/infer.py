"""The infer endpoint as a bare ASGI handler: no routing layers, no pydantic, one decode per tensor."""

from __future__ import annotations

import re
import time
from dataclasses import replace
from typing import Any

from geserve.codecs.digits import decimal_value, shortened
from geserve.core.api import InferenceAPI
from geserve.errors import DecoupledModelError, InvalidArgumentError, TooLargeError, UnsupportedError
from geserve.frontdoor import header_forwarding
from geserve.http import codec
from geserve.http.body import ClientDisconnectedError, accepted_encoding, compress, decoded, read_body
from geserve.http.direct import BODY_EXTENSION
from geserve.http.disconnect import DISCONNECT_EXTENSION
from geserve.http.errors import JSON_CONTENT, error_body, failure
from geserve.offload import COPY_BYTES, off_loop
from geserve.settings import DEFAULT_MAX_JSON_SIZE
from geserve.types import InferRequest, TraceContext, TraceRecord

# Triton's model route, infer action. Like Triton's, it matches numeric versions only: anything
# else falls through to the other routes, which answer 404.
INFER_PATH = re.compile(r"^/v2/models/([^/]+)(?:/versions/([0-9]+))?/infer$")
# Triton's text for a decoupled model asked for one response.
DECOUPLED_REFUSAL = "HTTP end point doesn't support models with decoupled transaction policy"


class InferEndpoint:
    """POST /v2/models/<m>[/versions/<v>]/infer, answered straight over ASGI."""

    def __init__(
        self,
        service: InferenceAPI,
        max_input_size: int,
        max_json_size: int = DEFAULT_MAX_JSON_SIZE,
        header_forward_pattern: str = "",
    ) -> None:
        self._service = service
        self._limit = max_input_size
        self._json_limit = max_json_size
        self._forward = header_forwarding.compile_pattern(header_forward_pattern, "--http-header-forward-pattern")

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any, match: re.Match[str]) -> None:
        if scope["method"] != "POST":
            await send_response(send, 405, error_body("Method Not Allowed"))
            return
        received_ns = time.monotonic_ns()  # the request's head is in: HTTP_RECV_START, should it be traced
        model_name, version = match.group(1), match.group(2) or ""
        headers = {key: value for key, value in scope["headers"]}
        moments: list[int] = []  # HTTP_RECV_END once the body is in, INFER_RESPONSE_COMPLETE once the core answered
        try:
            content, response_headers, trace = await self._infer(
                scope, model_name, version, headers, receive, moments=moments
            )
        except ClientDisconnectedError:
            return
        except Exception as error:
            status, body = failure(error, f"infer for model '{model_name}'")
            await send_response(send, status, body)
            return
        if trace is None:
            await send_response(send, 200, content, response_headers)
            return
        sending_ns = time.monotonic_ns()
        await send_response(send, 200, content, response_headers)
        before = (("HTTP_RECV_START", received_ns), ("HTTP_RECV_END", moments[0]))
        after = (("INFER_RESPONSE_COMPLETE", moments[1]), ("HTTP_SEND_START", sending_ns))
        await self._service.record_trace(trace.around(before, (*after, ("HTTP_SEND_END", time.monotonic_ns()))))

    async def _infer(
        self,
        scope: dict[str, Any],
        model_name: str,
        version: str,
        headers: dict[bytes, bytes],
        receive: Any,
        *,
        moments: list[int],
    ) -> tuple[bytes, list[tuple[bytes, bytes]], TraceRecord | None]:
        direct = scope.get("extensions", {}).get(BODY_EXTENSION)
        if direct is not None:  # read straight into one buffer by the connection (within the limit)
            sent: bytes | memoryview = await direct.read()
        else:
            declared = headers.get(b"content-length")
            sent = await read_body(receive, declared.decode("latin-1") if declared is not None else None, self._limit)
        moments.append(time.monotonic_ns())
        body = await decoded(sent, headers.get(b"content-encoding", b"").decode("latin-1"), self._limit)
        raw_length = headers.get(b"inference-header-content-length")
        header_length = raw_length.decode("latin-1") if raw_length is not None else None
        view = memoryview(body)
        if header_length is None:
            header_size = len(body)
        else:
            declared_size = decimal_value(header_length)
            if declared_size is None or declared_size > len(body):
                raise InvalidArgumentError(
                    f"inference header size should be in range (0, {len(body)}), got: {shortened(header_length)}"
                )
            header_size = declared_size
        if header_size == 0 and header_length is not None:
            request = codec.raw_request(view, model_name, version)  # shaped where the model is found
            encoding = codec.ALL_BINARY
        else:
            if header_size > self._json_limit:
                raise json_too_large(header_size, self._json_limit)
            # Parsing the JSON and its tensor data grows with it: large headers leave the loop.
            request, encoding = await off_loop(
                header_size, COPY_BYTES, _decode, view[:header_size], view[header_size:], model_name, version
            )
        request = with_trace_context(request, headers)
        if self._forward is not None:
            pairs = ((key.decode("latin-1"), value.decode("latin-1")) for key, value in headers.items())
            request = header_forwarding.with_forwarded(request, self._forward, pairs)
        client = scope.get("extensions", {}).get(DISCONNECT_EXTENSION)
        try:
            if client is None:
                response = await self._service.infer(request)
            else:  # a client that goes away cancels the request (ClientDisconnectedError here)
                response = await client.until_lost(self._service.infer(request))
        except DecoupledModelError:
            raise UnsupportedError(DECOUPLED_REFUSAL).with_request_id(request.id) from None
        if response.trace is not None:
            moments.append(time.monotonic_ns())
        json_header, blobs = codec.encode_response(response, encoding)
        if blobs:
            content = b"".join((json_header, *blobs))
            response_headers = [
                (b"content-type", b"application/octet-stream"),
                (codec.HEADER_LENGTH.lower().encode(), str(len(json_header)).encode()),
            ]
        else:
            content, response_headers = json_header, [JSON_CONTENT]
        compression = accepted_encoding(headers.get(b"accept-encoding", b"").decode("latin-1"))
        if compression:
            content = await compress(content, compression)
            response_headers.append((b"content-encoding", compression.encode()))
        return content, response_headers, response.trace


def _decode(
    header: memoryview, binary: memoryview, model_name: str, version: str
) -> tuple[InferRequest, codec.OutputEncoding]:
    return codec.decode_request(codec.loads(header), binary, model_name, version)


def json_too_large(size: int, limit: int) -> TooLargeError:
    """Triton's words for a body past --http-max-input-size, for JSON past --http-max-json-size."""
    return TooLargeError(
        f"Request JSON size of {size} bytes exceeds the maximum allowed value of {limit} bytes. Send large tensors "
        "as binary data (the binary tensor extension), or use --http-max-json-size to increase the limit."
    )


def with_trace_context(request: InferRequest, headers: dict[bytes, bytes]) -> InferRequest:
    """The request with the W3C trace context its headers carry (`traceparent`, `tracestate`), which the engine
    continues in trace mode opentelemetry, as Triton's HTTPAPIServer::StartTrace (HttpTextMapCarrier) does. One
    lookup in the headers already read when there is none."""
    traceparent = headers.get(b"traceparent")
    if traceparent is None:
        return request
    context = TraceContext(traceparent.decode("latin-1"), headers.get(b"tracestate", b"").decode("latin-1"))
    return replace(request, trace_context=context)


async def send_response(
    send: Any, status: int, content: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    """A whole response over ASGI; JSON unless `headers` say otherwise."""
    headers = [JSON_CONTENT] if headers is None else headers
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*headers, (b"content-length", str(len(content)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": content})
