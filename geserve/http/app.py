"""The FastAPI application: routes plus Triton's error bodies for every failure."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException
from starlette.responses import Response

import geserve
from geserve.core.service import InferenceService
from geserve.errors import GeserveError
from geserve.http.errors import error_response, from_error, unexpected_message
from geserve.http.infer import INFER_PATH, InferEndpoint
from geserve.http.routes import build_router

logger = logging.getLogger(__name__)

DEFAULT_MAX_INPUT_SIZE = 1 << 26  # 64 MiB, Triton's --http-max-input-size


class HttpApp:
    """The ASGI app uvicorn serves: infer requests go straight to InferEndpoint, the rest to FastAPI."""

    def __init__(self, api: FastAPI, infer: InferEndpoint) -> None:
        self.api = api
        self._infer = infer

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            match = INFER_PATH.match(scope["path"])
            if match is not None:
                await self._infer(scope, receive, send, match)
                return
        await self.api(scope, receive, send)


def create_app(service: InferenceService, max_input_size: int = DEFAULT_MAX_INPUT_SIZE) -> HttpApp:
    return HttpApp(create_api(service), InferEndpoint(service, max_input_size))


def create_api(service: InferenceService) -> FastAPI:
    """Every route but infer: health, metadata, config, statistics."""
    app = FastAPI(title="geserve", version=geserve.__version__, docs_url=None, redoc_url=None, openapi_url=None)
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
