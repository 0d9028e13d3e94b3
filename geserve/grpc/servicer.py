"""inference.GRPCInferenceService and grpc.health.v1.Health, answering from the InferenceAPI."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import grpc
from google.protobuf import json_format

from geserve._generated import grpc_service_pb2 as pb
from geserve._generated import grpc_service_pb2_grpc as pb_grpc
from geserve._generated import health_pb2, health_pb2_grpc
from geserve.core.api import InferenceAPI
from geserve.errors import DecoupledModelError, GeserveError, InvalidArgumentError, UnsupportedError
from geserve.frontdoor import header_forwarding
from geserve.grpc import convert
from geserve.grpc.decoding import decoded
from geserve.grpc.errors import GRPC_STATUS
from geserve.grpc.raw import InferMessage, InferReply
from geserve.memory import TRIM_AFTER_BYTES, trim_soon
from geserve.types import InferRequest, StreamedResponse, TraceContext, TraceMark, TraceRecord

logger = logging.getLogger(__name__)

Request = TypeVar("Request")
Response = TypeVar("Response")
Servicer = TypeVar("Servicer")
Context = grpc.aio.ServicerContext[Any, Any]
# Per stream: requests in flight at once, and answers waiting to be written, before reading pauses.
STREAM_MAX_IN_FLIGHT = 256
STREAM_MAX_PENDING_RESPONSES = 256
GRPC_ERROR_HEADER = "triton_grpc_error"


def _unary(
    method: Callable[[Servicer, Request], Awaitable[Response]],
) -> Callable[[Servicer, Request, Context], Coroutine[Any, Any, Response]]:
    """One unary RPC: what `method` answers, or its GeserveError as the status and message."""

    @functools.wraps(method)
    async def rpc(servicer: Servicer, request: Request, context: Context) -> Response:
        return await _answer(context, lambda: method(servicer, request))

    return rpc


async def _answer(context: Context, produce: Callable[[], Awaitable[Response]]) -> Response:
    """Run one unary RPC, turning GeserveError into its status and message."""
    try:
        return await produce()
    except GeserveError as error:
        status, message = GRPC_STATUS[error.code], error.message
    except Exception as error:
        logger.exception("unexpected error in a gRPC call")
        status, message = grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}"
    # Aborted outside the handler: grpc keeps the abort's exception, which would chain the error, its traceback and
    # so the request's frames and megabytes (a refused 300 MiB message kept 300 MiB for good).
    await context.abort(status, message)
    raise AssertionError("unreachable: abort raises")


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
    """The stream messages for one response of a request. Every response says whether it is the last
    (`triton_final_response`, as Triton's stream_infer_handler.cc sets it on each one it writes); with
    `triton_enable_empty_final_response` a bare FINAL becomes an empty response."""
    messages = []
    if item.error is not None:
        messages.append(_stream_error(request, item.error.message))
    if item.response is not None:
        message = pb.ModelStreamInferResponse(infer_response=convert.infer_reply(item.response).to_message())
        message.infer_response.parameters[convert.FINAL_RESPONSE].bool_param = item.final
        messages.append(message)
    elif item.final and final_flag:
        empty = pb.ModelInferResponse(model_name=request.model_name, model_version=request.model_version, id=request.id)
        empty.parameters[convert.FINAL_RESPONSE].bool_param = True
        messages.append(pb.ModelStreamInferResponse(infer_response=empty))
    return messages


def _trace_context(metadata: Any) -> TraceContext | None:
    """The W3C trace context a call's metadata carries (`traceparent`, `tracestate`), as Triton's GrpcServerCarrier
    reads it for the engine to continue in trace mode opentelemetry."""
    found = {key: value for key, value in metadata or () if key in ("traceparent", "tracestate")}
    traceparent = found.get("traceparent")
    if not isinstance(traceparent, str):
        return None
    tracestate = found.get("tracestate", "")
    return TraceContext(traceparent, tracestate if isinstance(tracestate, str) else "")


# Triton's text for a decoupled model asked for one response.
DECOUPLED_UNARY_RPC_REFUSAL = "ModelInfer RPC doesn't support models with decoupled transaction policy"


@dataclass(frozen=True, slots=True)
class _Traced:
    """A stream's message that answers a traced request, and what to tell when it is written."""

    message: pb.ModelStreamInferResponse
    sent: Callable[[int, int], None]


class _StreamEnd:
    """Marks the end of a stream's answers, with the status to close it with, if any."""

    def __init__(self, error: GeserveError | None = None) -> None:
        self.error = error


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    """Every RPC of the service; the HTTP twins' validation and messages, through the same service."""

    def __init__(self, service: InferenceAPI, *, trace_context: bool = False, header_forward_pattern: str = "") -> None:
        self._service = service
        # --grpc-header-forward-pattern: call metadata passed on to the model as request parameters.
        self._forward = header_forwarding.compile_pattern(header_forward_pattern, "--grpc-header-forward-pattern")
        self._recording: set[asyncio.Task[None]] = set()  # traces on their way to be written
        # Whether ModelInfer reads a client's trace context from its metadata (trace mode opentelemetry): grpc.aio
        # builds a call's metadata anew each time it is asked for (~1 us), which no other unary request needs.
        self._trace_context = trace_context

    async def ServerLive(self, request: pb.ServerLiveRequest, context: Context) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=await self._service.live())

    async def ServerReady(self, request: pb.ServerReadyRequest, context: Context) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=await self._service.ready())

    @_unary
    async def ModelReady(self, request: pb.ModelReadyRequest) -> pb.ModelReadyResponse:
        return pb.ModelReadyResponse(ready=await self._service.model_ready(request.name, request.version))

    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: Context) -> pb.ServerMetadataResponse:
        metadata = await self._service.server_metadata()
        return pb.ServerMetadataResponse(name=metadata.name, version=metadata.version, extensions=metadata.extensions)

    @_unary
    async def ModelMetadata(self, request: pb.ModelMetadataRequest) -> pb.ModelMetadataResponse:
        return convert.metadata_to_proto(await self._service.model_metadata(request.name, request.version))

    @_unary
    async def ModelConfig(self, request: pb.ModelConfigRequest) -> pb.ModelConfigResponse:
        return pb.ModelConfigResponse(config=await self._service.model_config(request.name, request.version))

    async def _infer(
        self,
        request: pb.ModelInferRequest,
        raw: Sequence[memoryview] | None = None,
        received_ns: int = 0,
        trace_context: TraceContext | None = None,
        metadata: Any = None,
    ) -> InferReply:
        read_ns = time.monotonic_ns()
        infer_request = self._with_forwarded(convert.infer_request_from_proto(request, raw), metadata)
        if trace_context is not None:
            infer_request = replace(infer_request, trace_context=trace_context)
        try:
            response = await self._service.infer(infer_request)
        except DecoupledModelError:
            raise UnsupportedError(DECOUPLED_UNARY_RPC_REFUSAL).with_request_id(infer_request.id) from None
        reply = convert.infer_reply(response)
        if response.trace is None:
            return reply
        before = (("GRPC_WAITREAD_START", received_ns or read_ns), ("GRPC_WAITREAD_END", read_ns))
        return replace(reply, sent=self._on_sent(response.trace, before))

    def _with_forwarded(self, request: InferRequest, metadata: Any) -> InferRequest:
        """The request with the call metadata --grpc-header-forward-pattern matches as string parameters."""
        if self._forward is None:
            return request
        pairs = ((key, value) for key, value in metadata or () if isinstance(value, str))  # `-bin` keys are bytes
        return header_forwarding.with_forwarded(request, self._forward, pairs)

    def _on_sent(self, trace: TraceRecord, before: tuple[TraceMark, ...]) -> Callable[[int, int], None]:
        """What a traced answer calls once it is on its way: the trace, completed, goes to be written."""
        complete_ns = time.monotonic_ns()

        def sent(started_ns: int, ended_ns: int) -> None:
            after = (("INFER_RESPONSE_COMPLETE", complete_ns), ("GRPC_SEND_START", started_ns))
            done = trace.around(before, (*after, ("GRPC_SEND_END", ended_ns)))
            task = asyncio.get_running_loop().create_task(self._service.record_trace(done))
            self._recording.add(task)
            task.add_done_callback(self._recording.discard)

        return sent

    # The reply leaves through `serialize_infer_reply` (decoding.add_service), not protobuf's serializer.
    async def ModelInfer(  # type: ignore[override]
        self, request: pb.ModelInferRequest | InferMessage, context: Context
    ) -> InferReply:
        traced = _trace_context(context.invocation_metadata()) if self._trace_context else None
        metadata = context.invocation_metadata() if self._forward is not None else None
        # Registered with `parse_infer_request`, which leaves the raw contents in the received bytes.
        if isinstance(request, InferMessage):
            message, raw, received_ns = request.message, request.raw_input_contents, request.received_ns
            try:
                return await _answer(context, lambda: self._infer(message, raw, received_ns, traced, metadata))
            finally:
                if request.size > TRIM_AFTER_BYTES:
                    trim_soon()  # answered or refused, its megabytes stay with the process otherwise
        return await _answer(context, lambda: self._infer(request, trace_context=traced, metadata=metadata))

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[pb.ModelInferRequest], context: Context
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Answers in completion order; errors go in `error_message` and the stream stays open, unless
        the client sent `triton_grpc_error: true`, which closes the stream with the error's status."""
        stream_metadata = context.invocation_metadata() or ()
        metadata = {key.lower(): value for key, value in stream_metadata}
        close_on_error = str(metadata.get(GRPC_ERROR_HEADER, "")).lower() == "true"
        traced = _trace_context(metadata.items())  # every request of the stream continues the stream's context
        answers: asyncio.Queue[pb.ModelStreamInferResponse | _Traced | _StreamEnd] = asyncio.Queue(
            STREAM_MAX_PENDING_RESPONSES
        )
        slots = asyncio.Semaphore(STREAM_MAX_IN_FLIGHT)
        in_flight: set[asyncio.Task[None]] = set()

        async def answer(request: pb.ModelInferRequest, waited: tuple[TraceMark, ...]) -> None:
            final_flag = convert.wants_final_flag(request)
            try:
                infer_request = self._with_forwarded(convert.infer_request_from_proto(request), stream_metadata)
                if traced is not None:
                    infer_request = replace(infer_request, trace_context=traced)
                async for item in self._service.infer_stream(infer_request):
                    if item.error is not None and close_on_error:
                        # Triton writes the responses before it and ends the stream with the error's status.
                        if item.response is not None:
                            await answers.put(_stream_messages(request, replace(item, error=None), final_flag)[0])
                        await answers.put(_StreamEnd(item.error))
                        return
                    messages = _stream_messages(request, item, final_flag)
                    trace = item.response.trace if item.response is not None else None
                    for index, response in enumerate(messages):
                        if trace is not None and index == len(messages) - 1:  # the response's message is the last
                            await answers.put(_Traced(response, self._on_sent(trace, waited)))
                        else:
                            await answers.put(response)
            except GeserveError as error:
                if close_on_error:
                    await answers.put(_StreamEnd(error))
                    return
                await answers.put(_stream_error(request, error.message))
            finally:
                slots.release()

        async def read() -> None:
            try:
                waiting_ns = time.monotonic_ns()  # GRPC_WAITREAD_START of the next request, should it be traced
                async for request in decoded(request_iterator):
                    waited = (("GRPC_WAITREAD_START", waiting_ns), ("GRPC_WAITREAD_END", time.monotonic_ns()))
                    await slots.acquire()
                    task = asyncio.create_task(answer(request, waited))
                    in_flight.add(task)
                    task.add_done_callback(in_flight.discard)
                    waiting_ns = time.monotonic_ns()
            except ValueError as error:  # a message that does not parse ends the stream
                await answers.put(_StreamEnd(InvalidArgumentError(str(error))))
                return
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
                if isinstance(item, _Traced):
                    started_ns = time.monotonic_ns()
                    yield item.message  # resumed once it is written
                    item.sent(started_ns, time.monotonic_ns())
                    continue
                yield item
            await reader  # surfaces a failure of the reading side
        finally:
            reader.cancel()
            for task in list(in_flight):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader

    @_unary
    async def ModelStatistics(self, request: pb.ModelStatisticsRequest) -> pb.ModelStatisticsResponse:
        entries = await self._service.statistics(request.name, request.version)
        return json_format.ParseDict({"model_stats": entries}, pb.ModelStatisticsResponse())

    # -- model repository ------------------------------------------------------------------------

    @_unary
    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest) -> pb.RepositoryIndexResponse:
        _no_repository_name(request.repository_name)
        entries = await self._service.repository_index(request.ready)
        return pb.RepositoryIndexResponse(models=[pb.RepositoryIndexResponse.ModelIndex(**e) for e in entries])

    @_unary
    async def RepositoryModelLoad(self, request: pb.RepositoryModelLoadRequest) -> pb.RepositoryModelLoadResponse:
        _no_repository_name(request.repository_name)
        parameters = {key: _repository_parameter(value) for key, value in request.parameters.items()}
        await self._service.load_model(request.model_name, parameters)
        return pb.RepositoryModelLoadResponse()

    @_unary
    async def RepositoryModelUnload(self, request: pb.RepositoryModelUnloadRequest) -> pb.RepositoryModelUnloadResponse:
        _no_repository_name(request.repository_name)
        dependents = request.parameters.get("unload_dependents")
        await self._service.unload_model(request.model_name, bool(dependents and dependents.bool_param))
        return pb.RepositoryModelUnloadResponse()

    # -- shared memory -----------------------------------------------------------------------------

    @_unary
    async def SystemSharedMemoryStatus(
        self, request: pb.SystemSharedMemoryStatusRequest
    ) -> pb.SystemSharedMemoryStatusResponse:
        response = pb.SystemSharedMemoryStatusResponse()
        for region in await self._service.shared_memory_status(request.name):
            response.regions[region["name"]].CopyFrom(pb.SystemSharedMemoryStatusResponse.RegionStatus(**region))
        return response

    @_unary
    async def SystemSharedMemoryRegister(
        self, request: pb.SystemSharedMemoryRegisterRequest
    ) -> pb.SystemSharedMemoryRegisterResponse:
        await self._service.register_shared_memory(request.name, request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    @_unary
    async def SystemSharedMemoryUnregister(
        self, request: pb.SystemSharedMemoryUnregisterRequest
    ) -> pb.SystemSharedMemoryUnregisterResponse:
        await self._service.unregister_shared_memory(request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    @_unary
    async def CudaSharedMemoryStatus(
        self, request: pb.CudaSharedMemoryStatusRequest
    ) -> pb.CudaSharedMemoryStatusResponse:
        await self._service.cuda_shared_memory_status(request.name)
        return pb.CudaSharedMemoryStatusResponse()

    @_unary
    async def CudaSharedMemoryRegister(
        self, request: pb.CudaSharedMemoryRegisterRequest
    ) -> pb.CudaSharedMemoryRegisterResponse:
        await self._service.register_cuda_shared_memory()
        return pb.CudaSharedMemoryRegisterResponse()

    @_unary
    async def CudaSharedMemoryUnregister(
        self, request: pb.CudaSharedMemoryUnregisterRequest
    ) -> pb.CudaSharedMemoryUnregisterResponse:
        await self._service.unregister_cuda_shared_memory(request.name)
        return pb.CudaSharedMemoryUnregisterResponse()

    # -- trace and logging -------------------------------------------------------------------------

    @_unary
    async def TraceSetting(self, request: pb.TraceSettingRequest) -> pb.TraceSettingResponse:
        model = request.model_name or None
        changes = {key: list(value.value) or None for key, value in request.settings.items()}
        service = self._service
        settings = await (service.update_trace_settings(model, changes) if changes else service.trace_settings(model))
        response = pb.TraceSettingResponse()
        for key, value in settings.items():
            response.settings[key].value.extend(value if isinstance(value, list) else [value])
        return response

    @_unary
    async def LogSettings(self, request: pb.LogSettingsRequest) -> pb.LogSettingsResponse:
        changes = {}
        for key, value in request.settings.items():
            choice = value.WhichOneof("parameter_choice")
            changes[key] = getattr(value, choice) if choice else None
        service = self._service
        current_settings = await (service.update_log_settings(changes) if changes else service.log_settings())
        response = pb.LogSettingsResponse()
        for key, current in current_settings.items():
            if isinstance(current, bool):
                response.settings[key].bool_param = current
            elif isinstance(current, int):
                response.settings[key].uint32_param = current
            else:
                response.settings[key].string_param = current
        return response


def _no_repository_name(name: str) -> None:
    if name:
        raise UnsupportedError("'repository_name' specification is not supported")


def _repository_parameter(value: pb.ModelRepositoryParameter) -> Any:
    choice = value.WhichOneof("parameter_choice")
    return getattr(value, choice) if choice else None


class HealthServicer(health_pb2_grpc.HealthServicer):
    """grpc.health.v1: SERVING while the server is ready."""

    def __init__(self, service: InferenceAPI) -> None:
        self._service = service
        self._recording: set[asyncio.Task[None]] = set()  # traces on their way to be written

    async def Check(self, request: health_pb2.HealthCheckRequest, context: Context) -> health_pb2.HealthCheckResponse:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if await self._service.ready()
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        return health_pb2.HealthCheckResponse(status=status)
