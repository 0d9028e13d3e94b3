"""HTTP routes of the repository, shared-memory, logging and trace extensions."""

from __future__ import annotations

import base64
import binascii
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.exceptions import HTTPException
from starlette.responses import Response

from geserve.codecs.digits import is_decimal
from geserve.core.api import FILE_PREFIX, InferenceAPI
from geserve.errors import InvalidArgumentError, UnsupportedError

REPOSITORY_NAME_REFUSAL = "'repository_name' specification is not supported"


def _json(content: Any) -> Response:
    return Response(orjson.dumps(content), media_type="application/json")


async def _body(request: Request, limit: int) -> dict[str, Any]:
    """The JSON object a control request carries; an empty body is an empty object."""
    declared = request.headers.get("content-length")
    if declared is not None and is_decimal(declared) and int(declared) > limit:
        raise InvalidArgumentError(f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    raw = await request.body()
    if len(raw) > limit:
        raise InvalidArgumentError(f"request body of {len(raw)} bytes exceeds the limit of {limit} bytes")
    if not raw.strip():
        return {}
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as error:
        raise InvalidArgumentError(f"failed to parse the request JSON buffer: {error}") from None
    if not isinstance(body, dict):
        raise InvalidArgumentError("the request body must be a JSON object")
    return body


def _parameters(body: dict[str, Any]) -> dict[str, Any]:
    parameters = body.get("parameters", {})
    if not isinstance(parameters, dict):
        raise InvalidArgumentError("'parameters' must be a JSON object")
    return parameters


def _no_repository_name(repository: str | None) -> None:
    if repository:
        raise UnsupportedError(REPOSITORY_NAME_REFUSAL)


def build_extension_router(service: InferenceAPI, limit: int) -> APIRouter:
    router = APIRouter()

    # -- model repository ------------------------------------------------------------------------

    @router.post("/v2/repository/index")
    @router.post("/v2/repository/{repository}/index")
    async def repository_index(request: Request, repository: str | None = None) -> Response:
        _no_repository_name(repository)
        ready = (await _body(request, limit)).get("ready", False)
        if not isinstance(ready, bool):
            raise InvalidArgumentError("'ready' must be a boolean")
        return _json(await service.repository_index(ready))

    @router.post("/v2/repository/models/{model_name}/load")
    @router.post("/v2/repository/{repository}/models/{model_name}/load")
    async def repository_load(request: Request, model_name: str, repository: str | None = None) -> Response:
        _no_repository_name(repository)
        parameters = _parameters(await _body(request, limit))
        decoded: dict[str, Any] = {}
        for key, value in parameters.items():
            if key.startswith(FILE_PREFIX):
                if not isinstance(value, str):
                    raise InvalidArgumentError(f"'{key}' must hold base64 file contents")
                try:
                    decoded[key] = base64.b64decode(value, validate=True)
                except (binascii.Error, ValueError):
                    raise InvalidArgumentError(f"'{key}' is not valid base64") from None
            else:
                decoded[key] = value
        await service.load_model(model_name, decoded)
        return Response(status_code=200)

    @router.post("/v2/repository/models/{model_name}/unload")
    @router.post("/v2/repository/{repository}/models/{model_name}/unload")
    async def repository_unload(request: Request, model_name: str, repository: str | None = None) -> Response:
        _no_repository_name(repository)
        dependents = _parameters(await _body(request, limit)).get("unload_dependents", False)
        if not isinstance(dependents, bool):
            raise InvalidArgumentError("'unload_dependents' must be a boolean")
        await service.unload_model(model_name, dependents)
        return Response(status_code=200)

    # -- shared memory ---------------------------------------------------------------------------

    @router.get("/v2/systemsharedmemory/status")
    @router.get("/v2/systemsharedmemory/region/{region}/status")
    async def system_shm_status(region: str = "") -> Response:
        return _json(await service.shared_memory_status(region))

    @router.post("/v2/systemsharedmemory/region/{region}/register")
    async def system_shm_register(request: Request, region: str) -> Response:
        body = await _body(request, limit)
        await service.register_shared_memory(region, body.get("key"), body.get("offset", 0), body.get("byte_size"))
        return Response(status_code=200)

    @router.post("/v2/systemsharedmemory/unregister")
    @router.post("/v2/systemsharedmemory/region/{region}/unregister")
    async def system_shm_unregister(region: str = "") -> Response:
        await service.unregister_shared_memory(region)
        return Response(status_code=200)

    @router.get("/v2/cudasharedmemory/status")
    @router.get("/v2/cudasharedmemory/region/{region}/status")
    async def cuda_shm_status(region: str = "") -> Response:
        return _json(await service.cuda_shared_memory_status(region))

    @router.post("/v2/cudasharedmemory/region/{region}/register")
    async def cuda_shm_register(region: str) -> Response:
        await service.register_cuda_shared_memory()
        return Response(status_code=200)

    @router.post("/v2/cudasharedmemory/unregister")
    @router.post("/v2/cudasharedmemory/region/{region}/unregister")
    async def cuda_shm_unregister(region: str = "") -> Response:
        await service.unregister_cuda_shared_memory(region)
        return Response(status_code=200)

    # -- logging and trace -----------------------------------------------------------------------

    @router.get("/v2/logging")
    async def get_logging() -> Response:
        return _json(await service.log_settings())

    @router.post("/v2/logging")
    async def post_logging(request: Request) -> Response:
        return _json(await service.update_log_settings(await _body(request, limit)))

    @router.get("/v2/trace/setting")
    @router.get("/v2/models/{model_name}/trace/setting")
    async def get_trace(model_name: str | None = None) -> Response:
        return _json(await service.trace_settings(model_name))

    @router.post("/v2/trace/setting")
    @router.post("/v2/models/{model_name}/trace/setting")
    async def post_trace(request: Request, model_name: str | None = None) -> Response:
        return _json(await service.update_trace_settings(model_name, await _body(request, limit)))

    @router.get("/v2/models/{model_name}/versions/{version}/trace/setting")
    @router.post("/v2/models/{model_name}/versions/{version}/trace/setting")
    async def versioned_trace(model_name: str, version: str) -> Response:
        if not is_decimal(version):
            raise HTTPException(404, "Not Found")
        raise InvalidArgumentError("trace settings are per model, not per model version")

    return router
