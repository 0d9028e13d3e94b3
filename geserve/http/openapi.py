"""The REST surface's OpenAPI contract: typed bodies for every v2 and Triton-extension route, served by FastAPI."""

# The handlers parse and check their own bodies, so that every refusal carries Triton's text (protocol.md); these
# models describe those bodies for /openapi.json and /docs. They follow KServe's v2 REST spec
# (kserve/kserve docs/predict-api/v2/rest_predict_v2.yaml, vendored in tests/data/kserve/, which
# tests/unit/test_openapi.py holds this document to) and Triton's extension documents (triton-inference-server/server
# docs/protocol/extension_*.md).

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import models_json_schema

from geserve import __version__

_PATH_PARAMETER = re.compile(r"{(\w+)}")


class _Open(BaseModel):
    """A JSON object that may carry more members than those named (as the protocols allow)."""

    model_config = ConfigDict(extra="allow")


class ErrorResponse(_Open):
    error: str = Field(description="Why the request failed, in Triton's words")


class ServerMetadataResponse(_Open):
    name: str
    version: str
    extensions: list[str]


class MetadataTensor(_Open):
    name: str
    datatype: str
    shape: list[int] = Field(description="-1 for a dimension of any size (the batch, or a variable one)")


class ModelMetadataResponse(_Open):
    name: str
    versions: list[str] = Field(default_factory=list)
    platform: str
    inputs: list[MetadataTensor] = Field(default_factory=list)
    outputs: list[MetadataTensor] = Field(default_factory=list)


TensorData = list[Any]  # nested lists of numbers, strings or booleans, row-major (KServe's tensor_data)


class RequestInput(_Open):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] | None = Field(
        default=None, description="binary_data_size (binary extension), shared_memory_region/offset/byte_size"
    )
    data: TensorData | None = Field(default=None, description="absent when the tensor is binary or in shared memory")


class RequestOutput(_Open):
    name: str
    parameters: dict[str, Any] | None = Field(
        default=None, description="binary_data, classification, shared_memory_region/offset/byte_size"
    )


class InferenceRequest(_Open):
    id: str | None = None
    parameters: dict[str, Any] | None = Field(
        default=None, description="sequence_id, sequence_start/end, priority, timeout, binary_data_output, ..."
    )
    inputs: list[RequestInput]
    outputs: list[RequestOutput] | None = None


class ResponseOutput(_Open):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: TensorData | None = Field(default=None, description="absent when the output is binary or in shared memory")


class InferenceResponse(_Open):
    model_name: str
    model_version: str | None = None
    id: str | None = None
    parameters: dict[str, Any] | None = None
    outputs: list[ResponseOutput]


class Duration(_Open):
    count: int
    ns: int


class InferenceStatistics(_Open):
    success: Duration
    fail: Duration
    queue: Duration
    compute_input: Duration
    compute_infer: Duration
    compute_output: Duration
    cache_hit: Duration
    cache_miss: Duration


class BatchStatistics(_Open):
    batch_size: int
    compute_input: Duration
    compute_infer: Duration
    compute_output: Duration


class ModelStatistics(_Open):
    name: str
    version: str
    last_inference: int = Field(description="ms since the epoch of the last request")
    inference_count: int
    execution_count: int
    inference_stats: InferenceStatistics
    response_stats: dict[str, Any] = Field(default_factory=dict)
    batch_stats: list[BatchStatistics] = Field(default_factory=list)
    memory_usage: list[dict[str, Any]] = Field(default_factory=list)


class StatisticsResponse(_Open):
    model_stats: list[ModelStatistics]


class RepositoryIndexRequest(_Open):
    ready: bool = False


class RepositoryIndexEntry(_Open):
    name: str
    version: str | None = None
    state: str | None = Field(default=None, description="READY, UNAVAILABLE or LOADING")
    reason: str | None = None


class RepositoryLoadRequest(_Open):
    parameters: dict[str, Any] | None = Field(
        default=None, description='"config": a config.pbtxt in JSON form; "file:<path>": base64 file contents'
    )


class UnloadParameters(_Open):
    unload_dependents: bool = False


class RepositoryUnloadRequest(_Open):
    parameters: UnloadParameters | None = None


class SystemSharedMemoryRegion(_Open):
    name: str
    key: str
    offset: int
    byte_size: int


class SystemSharedMemoryRegisterRequest(_Open):
    key: str
    offset: int = 0
    byte_size: int


class CudaSharedMemoryRegion(_Open):
    name: str
    device_id: int
    byte_size: int


class RawHandle(_Open):
    b64: str


class CudaSharedMemoryRegisterRequest(_Open):
    raw_handle: RawHandle
    device_id: int
    byte_size: int


class LogSettings(_Open):
    log_file: str | None = None
    log_info: bool | None = None
    log_warning: bool | None = None
    log_error: bool | None = None
    log_verbose_level: int | None = None
    log_format: str | None = None


TraceSettings = dict[str, str | list[str] | None]  # trace_file, trace_level, trace_rate, ... (null: reset)


class GenerateRequest(_Open):
    """The generate extension: named inputs as JSON values, and parameters."""

    parameters: dict[str, Any] | None = None


class GenerateResponse(_Open):
    model_name: str
    model_version: str | None = None


@dataclass(frozen=True, slots=True)
class RouteDoc:
    """What the document says of one route: its summary, the model of its body and of its 200 answer."""

    summary: str
    request: type[BaseModel] | Any = None
    response: type[BaseModel] | Any = None
    empty: bool = False  # answers 200 with no body
    media_type: str = "application/json"


MODEL = "/v2/models/{model_name}"
VERSION = "/v2/models/{model_name}/versions/{version}"
REPOSITORIES = ("/v2/repository", "/v2/repository/{repository}")
SYSTEM_REGION = "/v2/systemsharedmemory/region/{region}"
CUDA_REGION = "/v2/cudasharedmemory/region/{region}"

ROUTES: dict[tuple[str, str], RouteDoc] = {
    ("GET", "/v2/health/live"): RouteDoc("Server live", empty=True),
    ("GET", "/v2/health/ready"): RouteDoc("Server ready", empty=True),
    ("GET", "/v2"): RouteDoc("Server metadata", response=ServerMetadataResponse),
    ("GET", "/v2/models/stats"): RouteDoc("Statistics of every model", response=StatisticsResponse),
    **{("GET", p + "/stats"): RouteDoc("Model statistics", response=StatisticsResponse) for p in (MODEL, VERSION)},
    **{("GET", p): RouteDoc("Model metadata", response=ModelMetadataResponse) for p in (MODEL, VERSION)},
    **{("GET", p + "/ready"): RouteDoc("Model ready", empty=True) for p in (MODEL, VERSION)},
    **{("GET", p + "/config"): RouteDoc("Model configuration", response=dict[str, Any]) for p in (MODEL, VERSION)},
    **{
        ("POST", p + "/infer"): RouteDoc("Inference", request=InferenceRequest, response=InferenceResponse)
        for p in (MODEL, VERSION)
    },
    **{
        ("POST", p + "/generate"): RouteDoc("Generate", request=GenerateRequest, response=GenerateResponse)
        for p in (MODEL, VERSION)
    },
    **{
        ("POST", p + "/generate_stream"): RouteDoc(
            "Generate, streamed as server-sent events of GenerateResponse objects",
            request=GenerateRequest,
            media_type="text/event-stream",
        )
        for p in (MODEL, VERSION)
    },
    **{
        ("POST", p + "/index"): RouteDoc(
            "Repository index", request=RepositoryIndexRequest, response=list[RepositoryIndexEntry]
        )
        for p in REPOSITORIES
    },
    **{
        ("POST", p + "/models/{model_name}/load"): RouteDoc("Load a model", request=RepositoryLoadRequest, empty=True)
        for p in REPOSITORIES
    },
    **{
        ("POST", p + "/models/{model_name}/unload"): RouteDoc(
            "Unload a model", request=RepositoryUnloadRequest, empty=True
        )
        for p in REPOSITORIES
    },
    **{
        ("GET", p): RouteDoc("System shared-memory status", response=list[SystemSharedMemoryRegion])
        for p in ("/v2/systemsharedmemory/status", SYSTEM_REGION + "/status")
    },
    ("POST", SYSTEM_REGION + "/register"): RouteDoc(
        "Register a system shared-memory region", request=SystemSharedMemoryRegisterRequest, empty=True
    ),
    **{
        ("POST", p): RouteDoc("Unregister system shared memory", empty=True)
        for p in ("/v2/systemsharedmemory/unregister", SYSTEM_REGION + "/unregister")
    },
    **{
        ("GET", p): RouteDoc("CUDA shared-memory status (none here)", response=list[CudaSharedMemoryRegion])
        for p in ("/v2/cudasharedmemory/status", CUDA_REGION + "/status")
    },
    ("POST", CUDA_REGION + "/register"): RouteDoc(
        "Register a CUDA shared-memory region (refused: no CUDA here)", request=CudaSharedMemoryRegisterRequest
    ),
    **{
        ("POST", p): RouteDoc("Unregister CUDA shared memory", empty=True)
        for p in ("/v2/cudasharedmemory/unregister", CUDA_REGION + "/unregister")
    },
    ("GET", "/v2/logging"): RouteDoc("Log settings", response=LogSettings),
    ("POST", "/v2/logging"): RouteDoc("Change log settings", request=LogSettings, response=LogSettings),
    **{
        ("GET", p): RouteDoc("Trace settings", response=TraceSettings)
        for p in ("/v2/trace/setting", MODEL + "/trace/setting")
    },
    **{
        ("POST", p): RouteDoc("Change trace settings", request=TraceSettings, response=TraceSettings)
        for p in ("/v2/trace/setting", MODEL + "/trace/setting")
    },
    **{
        (method, VERSION + "/trace/setting"): RouteDoc("Trace settings are per model: refused per version")
        for method in ("GET", "POST")
    },
}


def operation(method: str, path: str) -> dict[str, Any]:
    """What FastAPI's add_api_route takes to document one route: its summary, its answers and, through
    openapi_extra, its path parameters and request body (the handlers read those themselves)."""
    doc = ROUTES[(method, path)]
    responses: dict[int | str, dict[str, Any]] = {
        400: {"model": ErrorResponse, "description": "Bad request: the error in Triton's words"}
    }
    if doc.response is not None and doc.media_type == "application/json":
        responses[200] = {"model": doc.response, "description": "OK"}
    elif doc.media_type != "application/json":
        responses[200] = {"description": "OK", "content": {doc.media_type: {"schema": {"type": "string"}}}}
    extra: dict[str, Any] = {
        "parameters": [
            {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
            for name in _PATH_PARAMETER.findall(path)
        ]
    }
    if doc.request is not None:
        extra["requestBody"] = {"content": {"application/json": {"schema": _schema_of(doc.request)}}}
    return {
        "summary": doc.summary,
        "responses": responses,
        "openapi_extra": extra,
        "response_model": None,
        "response_description": "OK",
        "operation_id": _operation_id(method, path),
    }


def _schema_of(body: Any) -> dict[str, Any]:
    if isinstance(body, type) and issubclass(body, BaseModel):
        return {"$ref": f"#/components/schemas/{body.__name__}"}
    from pydantic import TypeAdapter

    return TypeAdapter(body).json_schema(ref_template="#/components/schemas/{model}")


def _operation_id(method: str, path: str) -> str:
    return f"{method.lower()}{re.sub(r'[^a-zA-Z0-9]+', '_', path)}".rstrip("_")


def install_openapi(app: FastAPI) -> None:
    """The document FastAPI serves, with the request bodies' models among its schemas (FastAPI adds only the
    models of the bodies it parses itself)."""

    def document() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title="geserve",
                version=__version__,
                summary="The KServe v2 / Triton inference protocol over HTTP/REST",
                routes=app.routes,
            )
            requests = [
                doc.request
                for doc in ROUTES.values()
                if isinstance(doc.request, type) and issubclass(doc.request, BaseModel)
            ]
            _, definitions = models_json_schema(
                [(model, "validation") for model in dict.fromkeys(requests)],
                ref_template="#/components/schemas/{model}",
            )
            schema.setdefault("components", {}).setdefault("schemas", {}).update(definitions.get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = document  # type: ignore[method-assign]
