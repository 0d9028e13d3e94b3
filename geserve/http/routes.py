"""HTTP handlers for health, metadata, config and infer, calling InferenceAPI."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter
from starlette.exceptions import HTTPException
from starlette.responses import Response

from geserve.codecs.digits import is_decimal
from geserve.core.api import InferenceAPI
from geserve.errors import InvalidArgumentError
from geserve.repository.config import config_to_json
from geserve.types import ModelMetadata


def _json(content: Any) -> Response:
    return Response(orjson.dumps(content), media_type="application/json")


def _version(version: str | None) -> str:
    # Triton's route regex only matches numeric versions; anything else is an unknown path.
    if version is None:
        return ""
    if not is_decimal(version):
        raise HTTPException(404, "Not Found")
    return version


def _metadata_json(metadata: ModelMetadata) -> dict[str, Any]:
    return {
        "name": metadata.name,
        "versions": list(metadata.versions),
        "platform": metadata.platform,
        "inputs": [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in metadata.inputs],
        "outputs": [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in metadata.outputs],
    }


def build_router(service: InferenceAPI) -> APIRouter:
    """All v2 routes of this slice, bound to one service."""
    router = APIRouter()

    @router.get("/v2/health/live")
    async def health_live() -> Response:
        return Response(status_code=200 if await service.live() else 400)

    @router.get("/v2/health/ready")
    async def health_ready() -> Response:
        return Response(status_code=200 if await service.ready() else 400)

    @router.get("/v2")
    async def server_metadata() -> Response:
        metadata = await service.server_metadata()
        return _json({"name": metadata.name, "version": metadata.version, "extensions": list(metadata.extensions)})

    # Matched before the model routes, as in Triton: "stats" is no model name here.
    @router.get("/v2/models/stats")
    async def all_statistics() -> Response:
        return _json({"model_stats": await service.statistics()})

    @router.get("/v2/models/{model_name}/stats")
    @router.get("/v2/models/{model_name}/versions/{version}/stats")
    async def model_statistics(model_name: str, version: str | None = None) -> Response:
        return _json({"model_stats": await service.statistics(model_name, _version(version))})

    @router.get("/v2/models/{model_name}")
    @router.get("/v2/models/{model_name}/versions/{version}")
    async def model_metadata(model_name: str, version: str | None = None) -> Response:
        return _json(_metadata_json(await service.model_metadata(model_name, _version(version))))

    @router.get("/v2/models/{model_name}/ready")
    @router.get("/v2/models/{model_name}/versions/{version}/ready")
    async def model_ready(model_name: str, version: str | None = None) -> Response:
        if await service.model_ready(model_name, _version(version)):
            return Response(status_code=200)
        raise InvalidArgumentError("Model version not ready")

    @router.get("/v2/models/{model_name}/config")
    @router.get("/v2/models/{model_name}/versions/{version}/config")
    async def model_config(model_name: str, version: str | None = None) -> Response:
        return _json(config_to_json(await service.model_config(model_name, _version(version))))

    return router
