"""Restricted gRPC protocols: calls of a restricted group need header `triton-grpc-protocol-<key>`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import grpc

from geserve.restrictions import allowed
from geserve.settings import Restriction

HEADER_PREFIX = "triton-grpc-protocol-"
_GROUPS = {
    "ServerLive": "health",
    "ServerReady": "health",
    "ModelReady": "health",
    "Check": "health",
    "ServerMetadata": "metadata",
    "ModelMetadata": "metadata",
    "ModelInfer": "inference",
    "ModelStreamInfer": "inference",
    "ModelConfig": "model-config",
    "ModelStatistics": "statistics",
    "RepositoryIndex": "model-repository",
    "RepositoryModelLoad": "model-repository",
    "RepositoryModelUnload": "model-repository",
    "SystemSharedMemoryStatus": "shared-memory",
    "SystemSharedMemoryRegister": "shared-memory",
    "SystemSharedMemoryUnregister": "shared-memory",
    "CudaSharedMemoryStatus": "shared-memory",
    "CudaSharedMemoryRegister": "shared-memory",
    "CudaSharedMemoryUnregister": "shared-memory",
    "TraceSetting": "trace",
    "LogSettings": "logging",
}


class RestrictionInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls of restricted groups that lack the header, before the servicer sees them."""

    def __init__(self, restrictions: Mapping[str, Restriction]) -> None:
        self._restrictions = dict(restrictions)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        method = handler_call_details.method.rsplit("/", 1)[-1]
        restriction = self._restrictions.get(_GROUPS.get(method, ""))
        if restriction is None:
            return await continuation(handler_call_details)
        metadata = {key.lower(): value for key, value in handler_call_details.invocation_metadata or ()}
        header = HEADER_PREFIX + restriction.key
        if allowed(restriction, lambda _: _text(metadata.get(header))):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        return _refusal(handler, header) if handler is not None else None


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode("latin-1") if isinstance(value, bytes) else str(value)


def _refusal(handler: grpc.RpcMethodHandler[Any, Any], header: str) -> grpc.RpcMethodHandler[Any, Any]:
    message = f"This protocol is restricted, expecting header '{header}'"

    async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(grpc.StatusCode.UNAVAILABLE, message)

    async def stream(request_iterator: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(grpc.StatusCode.UNAVAILABLE, message)
        yield  # an async generator, as streaming handlers are

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(
            stream,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    return grpc.unary_unary_rpc_method_handler(
        unary,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
