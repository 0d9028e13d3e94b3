"""HTTP routes of the repository, shared-memory, logging and trace extensions."""

from __future__ import annotations

import base64
import binascii
from typing import Any

import orjson
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from geserve.codecs.digits import decimal_over, is_decimal, shortened
from geserve.core.api import FILE_PREFIX, InferenceAPI
from geserve.errors import InvalidArgumentError, UnsupportedError
from geserve.http.routes import get, json_response, post

REPOSITORY_NAME_REFUSAL = "'repository_name' specification is not supported"


async def _body(request: Request, limit: int) -> dict[str, Any]:
    """The JSON object a control request carries; an empty body is an empty object."""
    declared = request.headers.get("content-length")
    if declared is not None and decimal_over(declared, limit):
        raise InvalidArgumentError(f"request body of {shortened(declared)} bytes exceeds the limit of {limit} bytes")
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


def _no_repository_name(repository: str) -> None:
    if repository:
        raise UnsupportedError(REPOSITORY_NAME_REFUSAL)


def _path(request: Request, name: str) -> str:
    """A path parameter; "" where the route has none of that name."""
    value: str = request.path_params.get(name, "")
    return value


def build_extension_routes(service: InferenceAPI, limit: int) -> list[Route]:
    # -- model repository ------------------------------------------------------------------------

    async def repository_index(request: Request) -> Response:
        _no_repository_name(_path(request, "repository"))
        ready = (await _body(request, limit)).get("ready", False)
        if not isinstance(ready, bool):
            raise InvalidArgumentError("'ready' must be a boolean")
        return json_response(await service.repository_index(ready))

    async def repository_load(request: Request) -> Response:
        _no_repository_name(_path(request, "repository"))
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
        await service.load_model(_path(request, "model_name"), decoded)
        return Response(status_code=200)

    async def repository_unload(request: Request) -> Response:
        _no_repository_name(_path(request, "repository"))
        dependents = _parameters(await _body(request, limit)).get("unload_dependents", False)
        if not isinstance(dependents, bool):
            raise InvalidArgumentError("'unload_dependents' must be a boolean")
        await service.unload_model(_path(request, "model_name"), dependents)
        return Response(status_code=200)

    # -- shared memory ---------------------------------------------------------------------------

    async def system_shm_status(request: Request) -> Response:
        return json_response(await service.shared_memory_status(_path(request, "region")))

    async def system_shm_register(request: Request) -> Response:
        body = await _body(request, limit)
        region = _path(request, "region")
        await service.register_shared_memory(region, body.get("key"), body.get("offset", 0), body.get("byte_size"))
        return Response(status_code=200)

    async def system_shm_unregister(request: Request) -> Response:
        await service.unregister_shared_memory(_path(request, "region"))
        return Response(status_code=200)

    async def cuda_shm_status(request: Request) -> Response:
        return json_response(await service.cuda_shared_memory_status(_path(request, "region")))

    async def cuda_shm_register(request: Request) -> Response:
        await service.register_cuda_shared_memory()
        return Response(status_code=200)

    async def cuda_shm_unregister(request: Request) -> Response:
        await service.unregister_cuda_shared_memory(_path(request, "region"))
        return Response(status_code=200)

    # -- logging and trace -----------------------------------------------------------------------

    async def get_logging(request: Request) -> Response:
        return json_response(await service.log_settings())

    async def post_logging(request: Request) -> Response:
        return json_response(await service.update_log_settings(await _body(request, limit)))

    async def get_trace(request: Request) -> Response:
        return json_response(await service.trace_settings(_path(request, "model_name") or None))

    async def post_trace(request: Request) -> Response:
        changes = await _body(request, limit)
        return json_response(await service.update_trace_settings(_path(request, "model_name") or None, changes))

    async def versioned_trace(request: Request) -> Response:
        if not is_decimal(_path(request, "version")):
            raise HTTPException(404, "Not Found")
        raise InvalidArgumentError("trace settings are per model, not per model version")

    repository = ("/v2/repository", "/v2/repository/{repository}")
    system_region = "/v2/systemsharedmemory/region/{region}"
    cuda_region = "/v2/cudasharedmemory/region/{region}"
    model_trace = "/v2/models/{model_name}/trace/setting"
    version_trace = "/v2/models/{model_name}/versions/{version}/trace/setting"
    return [
        *(post(prefix + "/index", repository_index) for prefix in repository),
        *(post(prefix + "/models/{model_name}/load", repository_load) for prefix in repository),
        *(post(prefix + "/models/{model_name}/unload", repository_unload) for prefix in repository),
        get("/v2/systemsharedmemory/status", system_shm_status),
        get(system_region + "/status", system_shm_status),
        post(system_region + "/register", system_shm_register),
        post("/v2/systemsharedmemory/unregister", system_shm_unregister),
        post(system_region + "/unregister", system_shm_unregister),
        get("/v2/cudasharedmemory/status", cuda_shm_status),
        get(cuda_region + "/status", cuda_shm_status),
        post(cuda_region + "/register", cuda_shm_register),
        post("/v2/cudasharedmemory/unregister", cuda_shm_unregister),
        post(cuda_region + "/unregister", cuda_shm_unregister),
        get("/v2/logging", get_logging),
        post("/v2/logging", post_logging),
        get("/v2/trace/setting", get_trace),
        get(model_trace, get_trace),
        post("/v2/trace/setting", post_trace),
        post(model_trace, post_trace),
        get(version_trace, versioned_trace),
        post(version_trace, versioned_trace),
    ]
