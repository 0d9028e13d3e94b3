"""Service registration whose request decoding cannot fail: a message that does not parse is INVALID_ARGUMENT."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import descriptor, message_factory

from geserve.grpc.raw import parse_infer_request, serialize_infer_reply

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Undecodable:
    """What a request deserializer returns instead of raising: grpc answers a raising deserializer
    with UNKNOWN and logs two tracebacks per message."""

    message: str


def add_service(server: grpc.aio.Server, service: descriptor.ServiceDescriptor, servicer: Any) -> None:
    """Register every method of `service` on `servicer`, with lenient request decoding."""
    handlers = {}
    for method in service.methods:
        request_class = message_factory.GetMessageClass(method.input_type)
        response_class = message_factory.GetMessageClass(method.output_type)
        implementation = getattr(servicer, method.name)
        # ModelInfer's megabytes of raw_input_contents stay in the received bytes (the stream's are parsed whole).
        parse = _lenient(request_class, parse_infer_request if method.name == "ModelInfer" else None)
        # ...and its outputs' bytes are copied once, into the reply.
        serialize = serialize_infer_reply if method.name == "ModelInfer" else response_class.SerializeToString
        if method.client_streaming and method.server_streaming:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                implementation, request_deserializer=parse, response_serializer=serialize
            )
        elif not method.client_streaming and not method.server_streaming:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _refusing_undecodable(implementation), request_deserializer=parse, response_serializer=serialize
            )
        else:
            raise ValueError(f"{service.full_name}.{method.name}: half-streaming methods are not served")
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


def _lenient(request_class: Any, parser: Callable[[bytes], Any] | None = None) -> Callable[[bytes], Any]:
    name = request_class.DESCRIPTOR.full_name
    parse_bytes = parser or request_class.FromString

    def parse(data: bytes) -> Any:
        try:
            return parse_bytes(data)
        except Exception as error:  # DecodeError, and RuntimeWarning-like failures of the C parser
            return Undecodable(f"unable to parse the request as {name}: {error}")

    return parse


def _refusing_undecodable(implementation: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    async def handle(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        if isinstance(request, Undecodable):
            logger.debug("refused a gRPC request: %s", request.message)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        try:
            return await implementation(request, context)
        except grpc.aio.AbortError as abort:
            # grpc keeps the abort's exception after the call: without the frames it passed through, and without this
            # frame's request, or a refused request's megabytes would stay with the process for good.
            del request
            raise abort.with_traceback(None) from None

    return handle


async def decoded(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """A stream's requests; an undecodable one ends it with ValueError."""
    async for request in requests:
        if isinstance(request, Undecodable):
            raise ValueError(request.message)
        yield request
