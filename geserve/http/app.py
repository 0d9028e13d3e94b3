"""The FastAPI application: routes plus Triton's error bodies for every failure."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException
from starlette.responses import Response

import geserve
from geserve.core.api import InferenceAPI
from geserve.errors import GeserveError
from geserve.http.errors import error_body, error_response, from_error, unexpected_message
from geserve.http.extensions import build_extension_router
from geserve.http.infer import INFER_PATH, InferEndpoint
from geserve.http.routes import build_router
from geserve.restrictions import allowed
from geserve.settings import DEFAULT_MAX_INPUT_SIZE, HttpSettings, Restriction

logger = logging.getLogger(__name__)


def api_group(path: str) -> str:
    """The restricted-API group of a path, with Triton's group names."""
    if path.startswith("/v2/health/") or path.endswith("/ready"):
        return "health"
    if path.startswith("/v2/repository"):
        return "model-repository"
    if path.startswith(("/v2/systemsharedmemory", "/v2/cudasharedmemory")):
        return "shared-memory"
    if path == "/v2/logging":
        return "logging"
    if path.endswith("/trace/setting"):
        return "trace"
    if path.endswith("/stats"):
        return "statistics"
    if path.endswith("/config"):
        return "model-config"
    if path.endswith("/infer"):
        return "inference"
    return "metadata"


class HttpApp:
    """The ASGI app uvicorn serves: infer requests go straight to InferEndpoint, the rest to FastAPI.
    Restricted API groups are checked first, before any body is read."""

    def __init__(
        self, api: FastAPI, infer: InferEndpoint, restrictions: Mapping[str, Restriction] | None = None
    ) -> None:
        self.api = api
        self._infer = infer
        self._restrictions = dict(restrictions or {})

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            if self._restrictions and not await self._permitted(scope, send):
                return
            match = INFER_PATH.match(scope["path"])
            if match is not None:
                await self._infer(scope, receive, send, match)
                return
        await self.api(scope, receive, send)

    async def _permitted(self, scope: dict[str, Any], send: Any) -> bool:
        restriction = self._restrictions.get(api_group(scope["path"]))
        if restriction is None:
            return True
        headers = {key.decode("latin-1").lower(): value.decode("latin-1") for key, value in scope["headers"]}
        if allowed(restriction, headers.get):
            return True
        body = error_body(f"This API is restricted, expecting header '{restriction.key}'")
        await send({"type": "http.response.start", "status": 403, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})
        return False


def create_app(service: InferenceAPI, settings: HttpSettings) -> HttpApp:
    limit = settings.max_input_size
    return HttpApp(create_api(service, limit), InferEndpoint(service, limit), settings.restrictions)


def create_api(service: InferenceAPI, max_input_size: int = DEFAULT_MAX_INPUT_SIZE) -> FastAPI:
    """Every route but infer: health, metadata, config, statistics and the control extensions."""
    app = FastAPI(title="geserve", version=geserve.__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(build_extension_router(service, max_input_size))
    app.include_router(build_router(service))

    async def on_geserve_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, GeserveError)
        return from_error(error)

    async def on_http_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, HTTPException)
        return error_response(str(error.detail), error.status_code)

    async def on_unexpected_error(request: Request, error: Exception) -> Response:
        logger.exception("unexpected error serving %s %s", request.method, request.url.path)
        return error_response(unexpected_message(error), 500)

    app.add_exception_handler(GeserveError, on_geserve_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected_error)
    return app
