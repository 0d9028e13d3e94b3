"""inference.GRPCInferenceService and grpc.health.v1.Health, answering from InferenceService."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf import json_format

from geserve._generated import grpc_service_pb2 as pb
from geserve._generated import grpc_service_pb2_grpc as pb_grpc
from geserve._generated import health_pb2, health_pb2_grpc
from geserve.core.service import DECOUPLED_UNARY_RPC_REFUSAL, InferenceService
from geserve.errors import GeserveError
from geserve.grpc import convert
from geserve.grpc.errors import GRPC_STATUS
from geserve.types import StreamedResponse

logger = logging.getLogger(__name__)

Response = TypeVar("Response")
Context = grpc.aio.ServicerContext[Any, Any]
# Per stream: requests in flight at once, and answers waiting to be written, before reading pauses.
STREAM_MAX_IN_FLIGHT = 256
STREAM_MAX_PENDING_RESPONSES = 256
GRPC_ERROR_HEADER = "triton_grpc_error"


async def _answer(context: Context, produce: Callable[[], Awaitable[Response]]) -> Response:
    """Run one unary RPC, turning GeserveError into its status and message."""
    try:
        return await produce()
    except GeserveError as error:
        await context.abort(GRPC_STATUS[error.code], error.message)
    except Exception as error:
        logger.exception("unexpected error in a gRPC call")
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}")
    raise AssertionError("unreachable: abort raises")


def _unimplemented_rpc(feature: str) -> Callable[..., Awaitable[Any]]:
    """An RPC handler that answers UNIMPLEMENTED naming `feature`."""

    async def handler(self: object, request: object, context: Context) -> Any:
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED, f"the {feature} extension is not supported by this server yet"
        )

    return handler


def _stream_error(request: pb.ModelInferRequest, message: str) -> pb.ModelStreamInferResponse:
    return pb.ModelStreamInferResponse(
        error_message=message,
        infer_response=pb.ModelInferResponse(
            model_name=request.model_name, model_version=request.model_version, id=request.id
        ),
    )


def _stream_messages(
    request: pb.ModelInferRequest, item: StreamedResponse, final_flag: bool
) -> list[pb.ModelStreamInferResponse]:
    """The stream messages for one response of a request. With `triton_enable_empty_final_response`
    every response says whether it is the last, and a bare FINAL becomes an empty response."""
    messages = []
    if item.error is not None:
        messages.append(_stream_error(request, item.error.message))
    if item.response is not None:
        message = pb.ModelStreamInferResponse(infer_response=convert.infer_response_to_proto(item.response))
        if final_flag:
            message.infer_response.parameters[convert.FINAL_RESPONSE].bool_param = item.final
        messages.append(message)
    elif item.final and final_flag:
        empty = pb.ModelInferResponse(model_name=request.model_name, model_version=request.model_version, id=request.id)
        empty.parameters[convert.FINAL_RESPONSE].bool_param = True
        messages.append(pb.ModelStreamInferResponse(infer_response=empty))
    return messages


class _StreamEnd:
    """Marks the end of a stream's answers, with the status to close it with, if any."""

    def __init__(self, error: GeserveError | None = None) -> None:
        self.error = error


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    """Every RPC of the service; the HTTP twins' validation and messages, through the same service."""

    def __init__(self, service: InferenceService) -> None:
        self._service = service

    async def ServerLive(self, request: pb.ServerLiveRequest, context: Context) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=self._service.live)

    async def ServerReady(self, request: pb.ServerReadyRequest, context: Context) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self._service.ready)

    async def ModelReady(self, request: pb.ModelReadyRequest, context: Context) -> pb.ModelReadyResponse:
        async def produce() -> pb.ModelReadyResponse:
            return pb.ModelReadyResponse(ready=self._service.model_ready(request.name, request.version))

        return await _answer(context, produce)

    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: Context) -> pb.ServerMetadataResponse:
        name, version, extensions = self._service.server_metadata()
        return pb.ServerMetadataResponse(name=name, version=version, extensions=extensions)

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: Context) -> pb.ModelMetadataResponse:
        async def produce() -> pb.ModelMetadataResponse:
            return convert.metadata_to_proto(self._service.model_metadata(request.name, request.version))

        return await _answer(context, produce)

    async def ModelConfig(self, request: pb.ModelConfigRequest, context: Context) -> pb.ModelConfigResponse:
        async def produce() -> pb.ModelConfigResponse:
            return pb.ModelConfigResponse(config=self._service.model_config(request.name, request.version))

        return await _answer(context, produce)

    async def _infer(self, request: pb.ModelInferRequest) -> pb.ModelInferResponse:
        infer_request = convert.infer_request_from_proto(request)
        return convert.infer_response_to_proto(await self._service.infer(infer_request, DECOUPLED_UNARY_RPC_REFUSAL))

    async def ModelInfer(self, request: pb.ModelInferRequest, context: Context) -> pb.ModelInferResponse:
        return await _answer(context, lambda: self._infer(request))

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[pb.ModelInferRequest], context: Context
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Answers in completion order; errors go in `error_message` and the stream stays open, unless
        the client sent `triton_grpc_error: true`, which closes the stream with the error's status."""
        metadata = {key.lower(): value for key, value in (context.invocation_metadata() or ())}
        close_on_error = str(metadata.get(GRPC_ERROR_HEADER, "")).lower() == "true"
        answers: asyncio.Queue[pb.ModelStreamInferResponse | _StreamEnd] = asyncio.Queue(STREAM_MAX_PENDING_RESPONSES)
        slots = asyncio.Semaphore(STREAM_MAX_IN_FLIGHT)
        in_flight: set[asyncio.Task[None]] = set()

        async def answer(request: pb.ModelInferRequest) -> None:
            final_flag = convert.wants_final_flag(request)
            try:
                async for item in self._service.infer_stream(convert.infer_request_from_proto(request)):
                    for response in _stream_messages(request, item, final_flag):
                        await answers.put(response)
            except GeserveError as error:
                if close_on_error:
                    await answers.put(_StreamEnd(error))
                    return
                await answers.put(_stream_error(request, error.message))
            finally:
                slots.release()

        async def read() -> None:
            async for request in request_iterator:
                await slots.acquire()
                task = asyncio.create_task(answer(request))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
            await asyncio.gather(*in_flight)
            await answers.put(_StreamEnd())

        reader = asyncio.create_task(read())
        try:
            while True:
                item = await answers.get()
                if isinstance(item, _StreamEnd):
                    if item.error is not None:
                        await context.abort(GRPC_STATUS[item.error.code], item.error.message)
                    break
                yield item
            await reader  # surfaces a failure of the reading side
        finally:
            reader.cancel()
            for task in list(in_flight):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader

    async def ModelStatistics(self, request: pb.ModelStatisticsRequest, context: Context) -> pb.ModelStatisticsResponse:
        async def produce() -> pb.ModelStatisticsResponse:
            entries = self._service.statistics(request.name, request.version)
            return json_format.ParseDict({"model_stats": entries}, pb.ModelStatisticsResponse())

        return await _answer(context, produce)

    # Extensions still to come answer UNIMPLEMENTED, naming the extension.
    RepositoryIndex = _unimplemented_rpc("model repository")
    RepositoryModelLoad = _unimplemented_rpc("model repository")
    RepositoryModelUnload = _unimplemented_rpc("model repository")
    SystemSharedMemoryStatus = _unimplemented_rpc("system shared memory")
    SystemSharedMemoryRegister = _unimplemented_rpc("system shared memory")
    SystemSharedMemoryUnregister = _unimplemented_rpc("system shared memory")
    CudaSharedMemoryStatus = _unimplemented_rpc("CUDA shared memory")
    CudaSharedMemoryRegister = _unimplemented_rpc("CUDA shared memory")
    CudaSharedMemoryUnregister = _unimplemented_rpc("CUDA shared memory")
    TraceSetting = _unimplemented_rpc("trace")
    LogSettings = _unimplemented_rpc("logging")


class HealthServicer(health_pb2_grpc.HealthServicer):
    """grpc.health.v1: SERVING while the server is ready."""

    def __init__(self, service: InferenceService) -> None:
        self._service = service

    async def Check(self, request: health_pb2.HealthCheckRequest, context: Context) -> health_pb2.HealthCheckResponse:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if self._service.ready
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        return health_pb2.HealthCheckResponse(status=status)
