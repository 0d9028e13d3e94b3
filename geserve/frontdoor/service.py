"""FrontDoor: the InferenceAPI the front-ends call; a request's own work here, its scheduling in the engine."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from typing import Any

from geserve import log_records
from geserve._generated import model_config_pb2 as mc
from geserve.core import limits, validation
from geserve.core.api import InferenceAPI
from geserve.core.raw import decoded_raw
from geserve.core.shared_memory import REGION
from geserve.errors import DecoupledModelError, GeserveError
from geserve.frontdoor.link import EngineLink
from geserve.frontdoor.placement import Placement
from geserve.frontdoor.responses import ClientRegions, ResponseBuilder
from geserve.offload import DECODE_BYTES, off_loop
from geserve.snapshots import ServedVersion, find_version
from geserve.submissions import Answer, Submission
from geserve.types import (
    CacheSnapshot,
    CustomMetric,
    DeviceUsage,
    InferRequest,
    InferResponse,
    ModelMetadata,
    ServerMetadata,
    StreamedResponse,
    TraceRecord,
    VersionSnapshot,
)

logger = logging.getLogger(__name__)


class FrontDoor:
    """Each request is checked against the version it addresses (the engine's models, or its snapshot of them), its
    inputs placed in shared memory, and handed to the engine as a Submission; its response is built here from the
    outputs where the worker left them. Every other call goes to the engine as it is. The same in one process and in
    each protocol process of several."""

    def __init__(self, link: EngineLink, placement: Placement, max_bytes_elements: int | None = None) -> None:
        self._link = link
        self._placement = placement
        self._max_bytes_elements = max_bytes_elements
        self._responses = ResponseBuilder(link.regions)

    # -- inference -------------------------------------------------------------------------

    async def infer(self, request: InferRequest) -> InferResponse:
        """One response; errors carry Triton's request-id prefix. A decoupled model answers only streams: the
        request fails with DecoupledModelError."""
        version, submission = await self._admit(request)
        try:
            if version.decoupled:
                raise DecoupledModelError(
                    f"model '{version.name}' is decoupled: it answers streams only"
                ).with_request_id(request.id)
            answer = await self._link.infer(submission)
            response = await self._respond(version, request, submission, answer)
        except GeserveError as error:
            _log_failure(request.model_name, version.version_str, request.id, error)
            raise
        assert response is not None
        return response

    async def infer_stream(self, request: InferRequest) -> AsyncIterator[StreamedResponse]:
        """Every response to one request, as the model sends them (one, final, for a model that is not decoupled).
        Errors before the model runs are raised; the model's own come as items."""
        version, submission = await self._admit(request)
        try:
            # Closed with this stream, not whenever it is collected: a client that leaves cancels the request at once.
            async with contextlib.aclosing(self._link.stream(submission)) as answers:
                async for answer in answers:
                    response = await self._respond(version, request, submission, answer)
                    yield StreamedResponse(response, answer.error, answer.final)
        except GeserveError as error:
            _log_failure(request.model_name, version.version_str, request.id, error)
            raise

    async def _admit(self, request: InferRequest) -> tuple[ServedVersion, Submission]:
        """The version a request addresses, and the request checked against it with its inputs in shared memory."""
        # Before anything quotes the id: an id over its bound is not repeated back in the error.
        try:
            limits.check_request(request.id, request.parameters)
        except GeserveError as error:
            _log_failure(request.model_name, request.model_version, "", error)  # an id over its bound is not logged
            raise
        try:
            validation.check_parameters(request.parameters)
            version = await self._version(request)
            request = decoded_raw(request, version.name, tuple(version.inputs.values()))
        except GeserveError as error:
            refusal = error.with_request_id(request.id)
            _log_failure(request.model_name, request.model_version, request.id, refusal)
            raise refusal from None
        try:
            inputs = await off_loop(
                validation.decode_cost(request),
                DECODE_BYTES,
                self._checked_inputs,
                request,
                version,
            )
            output_names = validation.requested_output_names(request, version)
        except GeserveError as error:
            self._link.refused(version.name, version.version)
            refusal = error.with_request_id(request.id)
            _log_failure(request.model_name, version.version_str, request.id, refusal)
            raise refusal from None
        submission = Submission(
            request.model_name,
            request.model_version,
            version.version,
            version.load,
            tuple(inputs.items()),
            output_names,
            request.parameters,
            request.id,
            request.trace_context,
        )
        return version, submission

    async def _version(self, request: InferRequest) -> ServedVersion:
        """The version a request addresses. A model or a client region it names that the snapshots lack is asked of
        the engine once before the request is refused: another protocol process may have just loaded or registered
        it, and the client, told it is done, expects it to serve (the pushed snapshot may still be on its way)."""
        try:
            version = find_version(self._link.models, request.model_name, request.model_version)
        except GeserveError:
            if not await self._link.refresh():
                raise
            version = find_version(self._link.models, request.model_name, request.model_version)
        else:
            if _unknown_regions(request, self._link.regions) and await self._link.refresh():
                version = find_version(self._link.models, request.model_name, request.model_version)
        return version

    def _checked_inputs(self, request: InferRequest, version: ServedVersion) -> dict[str, Any]:
        return validation.validate_inputs(
            request, version, self._link.regions, self._max_bytes_elements, place=self._placement.place
        )

    async def _respond(
        self, version: ServedVersion, request: InferRequest, submission: Submission, answer: Answer
    ) -> InferResponse | None:
        """The response the answer makes (None: a stream's empty final answer)."""
        if answer.outputs is None:
            return None
        if answer.model_version != version.version_str:  # the engine found another version than the one checked
            version = find_version(self._link.models, request.model_name, answer.model_version)
        try:
            response = await self._responses.build(
                version, request, submission.output_names, answer.outputs, answer.parameters
            )
        except GeserveError as error:
            raise error.with_request_id(request.id) from None
        return replace(response, trace=answer.trace) if answer.trace is not None else response

    # -- everything else is the engine's -----------------------------------------------------

    async def live(self) -> bool:
        return bool(await self._link.call("live"))

    async def ready(self) -> bool:
        return bool(await self._link.call("ready"))

    async def server_metadata(self) -> ServerMetadata:
        metadata: ServerMetadata = await self._link.call("server_metadata")
        return metadata

    async def model_ready(self, name: str, version: str = "") -> bool:
        return bool(await self._link.call("model_ready", name, version))

    async def model_metadata(self, name: str, version: str = "") -> ModelMetadata:
        metadata: ModelMetadata = await self._link.call("model_metadata", name, version)
        return metadata

    async def model_config(self, name: str, version: str = "") -> mc.ModelConfig:
        config: mc.ModelConfig = await self._link.call("model_config", name, version)
        return config

    async def repository_index(self, ready_only: bool = False) -> list[dict[str, str]]:
        index: list[dict[str, str]] = await self._link.call("repository_index", ready_only)
        return index

    async def load_model(self, name: str, parameters: Mapping[str, Any] | None = None) -> None:
        await self._link.call("load_model", name, parameters)

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        await self._link.call("unload_model", name, unload_dependents)

    async def shared_memory_status(self, name: str = "") -> list[dict[str, Any]]:
        status: list[dict[str, Any]] = await self._link.call("shared_memory_status", name)
        return status

    async def register_shared_memory(self, name: str, key: Any, offset: Any, byte_size: Any) -> None:
        await self._link.call("register_shared_memory", name, key, offset, byte_size)

    async def unregister_shared_memory(self, name: str = "") -> None:
        await self._link.call("unregister_shared_memory", name)

    async def cuda_shared_memory_status(self, name: str = "") -> list[dict[str, Any]]:
        status: list[dict[str, Any]] = await self._link.call("cuda_shared_memory_status", name)
        return status

    async def register_cuda_shared_memory(self) -> None:
        await self._link.call("register_cuda_shared_memory")

    async def unregister_cuda_shared_memory(self, name: str = "") -> None:
        await self._link.call("unregister_cuda_shared_memory", name)

    async def trace_settings(self, model: str | None = None) -> dict[str, list[str] | str]:
        settings: dict[str, list[str] | str] = await self._link.call("trace_settings", model)
        return settings

    async def update_trace_settings(self, model: str | None, changes: Mapping[str, Any]) -> dict[str, Any]:
        settings: dict[str, Any] = await self._link.call("update_trace_settings", model, dict(changes))
        return settings

    async def record_trace(self, trace: TraceRecord) -> None:
        await self._link.call("record_trace", trace)

    async def log_settings(self) -> dict[str, Any]:
        settings: dict[str, Any] = await self._link.call("log_settings")
        return settings

    async def update_log_settings(self, changes: dict[str, Any]) -> dict[str, Any]:
        settings: dict[str, Any] = await self._link.call("update_log_settings", changes)
        return settings

    async def statistics(self, name: str = "", version: str = "") -> list[dict[str, Any]]:
        statistics: list[dict[str, Any]] = await self._link.call("statistics", name, version)
        return statistics

    async def version_statistics(self) -> list[VersionSnapshot]:
        versions: list[VersionSnapshot] = await self._link.call("version_statistics")
        return versions

    async def device_usage(self) -> dict[int, DeviceUsage]:
        usage: dict[int, DeviceUsage] = await self._link.call("device_usage")
        return usage

    async def cache_statistics(self) -> CacheSnapshot | None:
        statistics: CacheSnapshot | None = await self._link.call("cache_statistics")
        return statistics

    async def custom_metrics(self) -> list[CustomMetric]:
        metrics: list[CustomMetric] = await self._link.call("custom_metrics")
        return metrics


def _log_failure(model: str, version: str, request_id: str, error: GeserveError) -> None:
    """A request that failed, at verbose level (--log-verbose 1) as Triton logs them: its client has the error; the
    log says which model, version and request it was."""
    if logger.isEnabledFor(logging.DEBUG):  # a flood of bad requests costs no more than their answers
        fields = log_records.request_fields(model, version, request_id)
        logger.debug("inference request failed: %s", error.message, extra=fields)


def _implements(front_door: FrontDoor) -> InferenceAPI:
    return front_door  # mypy checks that the front door implements the whole interface


def _unknown_regions(request: InferRequest, regions: ClientRegions) -> bool:
    """Whether the request names a client region `regions` does not hold."""
    named = [tensor.parameters.get(REGION) for tensor in request.inputs if tensor.parameters]
    named += [output.parameters.get(REGION) for output in request.outputs if output.parameters]
    return any(name is not None and name not in regions for name in named)
