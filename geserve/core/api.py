"""InferenceAPI: everything the front-ends ask of the core, as plain values that could cross a process boundary."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol

from geserve._generated import model_config_pb2 as mc
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

# A load request's parameter that carries a file of the model folder (`file:1/model.onnx`), as Triton's.
FILE_PREFIX = "file:"
# The latency families a VersionSnapshot may carry (nv_inference_<family>_summary_us), and the histogram's
# family, which a model's config names to set its buckets.
SUMMARY_FAMILIES = ("request", "queue", "compute_input", "compute_infer", "compute_output")
HISTOGRAM_FAMILY = "nv_inference_first_response_histogram_ms"


class EngineAPI(Protocol):
    """What the metrics endpoint calls, and what the front-ends call besides inference: health, metadata and the
    protocol extensions. The engine (`InferenceService`) answers them.

    Every method is a coroutine and every value is a snapshot: nothing returned stays connected to the state it
    was read from, and nothing is registered to be called back, so the engine may answer in this process or over a
    channel from another one.
    """

    # -- health and metadata ---------------------------------------------------------------

    async def live(self) -> bool: ...

    async def ready(self) -> bool: ...

    async def server_metadata(self) -> ServerMetadata: ...

    async def model_ready(self, name: str, version: str = "") -> bool: ...

    async def model_metadata(self, name: str, version: str = "") -> ModelMetadata: ...

    async def model_config(self, name: str, version: str = "") -> mc.ModelConfig: ...

    # -- the model repository extension ----------------------------------------------------

    async def repository_index(self, ready_only: bool = False) -> list[dict[str, str]]: ...

    async def load_model(self, name: str, parameters: Mapping[str, Any] | None = None) -> None: ...

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None: ...

    # -- the shared-memory extensions ------------------------------------------------------

    async def shared_memory_status(self, name: str = "") -> list[dict[str, Any]]: ...

    async def register_shared_memory(self, name: str, key: Any, offset: Any, byte_size: Any) -> None: ...

    async def unregister_shared_memory(self, name: str = "") -> None: ...

    async def cuda_shared_memory_status(self, name: str = "") -> list[dict[str, Any]]: ...

    async def register_cuda_shared_memory(self) -> None: ...

    async def unregister_cuda_shared_memory(self, name: str = "") -> None: ...

    # -- the trace and logging extensions --------------------------------------------------

    async def trace_settings(self, model: str | None = None) -> dict[str, list[str] | str]: ...

    async def update_trace_settings(self, model: str | None, changes: Mapping[str, Any]) -> dict[str, Any]: ...

    async def record_trace(self, trace: TraceRecord) -> None:
        """A response's trace (InferResponse.trace) with the front-end's receive and send moments added: written
        to the trace file (or the log). The front-end need not wait for it."""
        ...

    async def log_settings(self) -> dict[str, Any]: ...

    async def update_log_settings(self, changes: dict[str, Any]) -> dict[str, Any]: ...

    # -- statistics and metrics ------------------------------------------------------------

    async def statistics(self, name: str = "", version: str = "") -> list[dict[str, Any]]: ...

    async def version_statistics(self) -> list[VersionSnapshot]: ...

    async def device_usage(self) -> dict[int, DeviceUsage]: ...

    async def cache_statistics(self) -> CacheSnapshot | None:
        """The response cache's figures; None when the server has no cache."""
        ...

    async def custom_metrics(self) -> list[CustomMetric]: ...


class InferenceAPI(EngineAPI, Protocol):
    """What HTTP and gRPC call: the engine's API and inference, whose own work (checks, placing inputs, building
    responses) the front door (`frontdoor.service.FrontDoor`) does where the request was decoded."""

    # -- inference -------------------------------------------------------------------------

    async def infer(self, request: InferRequest) -> InferResponse:
        """One response; a request whose `raw_body` is set (HTTP's binary body without a JSON header) is shaped
        as the one input of the version it addresses."""
        ...

    def infer_stream(self, request: InferRequest) -> AsyncIterator[StreamedResponse]: ...
