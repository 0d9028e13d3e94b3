"""HTTP routes for health, metadata, config and statistics, calling InferenceAPI."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from geserve.codecs.digits import is_decimal
from geserve.core.api import InferenceAPI
from geserve.errors import InvalidArgumentError
from geserve.repository.config import config_to_json
from geserve.types import ModelMetadata


def json_response(content: Any) -> Response:
    return Response(orjson.dumps(content), media_type="application/json")


def _model_and_version(request: Request) -> tuple[str, str]:
    """The model name and version ("" when the path names none) a model route's path holds."""
    version = request.path_params.get("version", "")
    # Triton's route regex only matches numeric versions; anything else is an unknown path.
    if version and not is_decimal(version):
        raise HTTPException(404, "Not Found")
    return request.path_params["model_name"], version


def _metadata_json(metadata: ModelMetadata) -> dict[str, Any]:
    return {
        "name": metadata.name,
        "versions": list(metadata.versions),
        "platform": metadata.platform,
        "inputs": [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in metadata.inputs],
        "outputs": [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in metadata.outputs],
    }


def get(path: str, endpoint: Callable[[Request], Awaitable[Response]]) -> Route:
    """A GET route that, as Triton's, does not answer HEAD (Starlette adds HEAD to every GET route)."""
    route = Route(path, endpoint, methods=["GET"])
    route.methods = {"GET"}
    return route


def post(path: str, endpoint: Callable[[Request], Awaitable[Response]]) -> Route:
    return Route(path, endpoint, methods=["POST"])


def build_routes(service: InferenceAPI) -> list[Route]:
    """All v2 routes of this slice, bound to one service."""

    async def health_live(request: Request) -> Response:
        return Response(status_code=200 if await service.live() else 400)

    async def health_ready(request: Request) -> Response:
        return Response(status_code=200 if await service.ready() else 400)

    async def server_metadata(request: Request) -> Response:
        metadata = await service.server_metadata()
        return json_response(
            {"name": metadata.name, "version": metadata.version, "extensions": list(metadata.extensions)}
        )

    async def all_statistics(request: Request) -> Response:
        return json_response({"model_stats": await service.statistics()})

    async def model_statistics(request: Request) -> Response:
        return json_response({"model_stats": await service.statistics(*_model_and_version(request))})

    async def model_metadata(request: Request) -> Response:
        return json_response(_metadata_json(await service.model_metadata(*_model_and_version(request))))

    async def model_ready(request: Request) -> Response:
        if await service.model_ready(*_model_and_version(request)):
            return Response(status_code=200)
        raise InvalidArgumentError("Model version not ready")

    async def model_config(request: Request) -> Response:
        return json_response(config_to_json(await service.model_config(*_model_and_version(request))))

    model = "/v2/models/{model_name}"
    version = "/v2/models/{model_name}/versions/{version}"
    return [
        get("/v2/health/live", health_live),
        get("/v2/health/ready", health_ready),
        get("/v2", server_metadata),
        # Matched before the model routes, as in Triton: "stats" is no model name here.
        get("/v2/models/stats", all_statistics),
        *(get(prefix + "/stats", model_statistics) for prefix in (model, version)),
        *(get(prefix, model_metadata) for prefix in (model, version)),
        *(get(prefix + "/ready", model_ready) for prefix in (model, version)),
        *(get(prefix + "/config", model_config) for prefix in (model, version)),
    ]
