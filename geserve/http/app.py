"""The ASGI application: infer and generate straight to their endpoints, every other route through FastAPI."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from geserve.core.api import InferenceAPI
from geserve.errors import GeserveError
from geserve.http.errors import error_body, error_response, failure
from geserve.http.extensions import build_extension_routes
from geserve.http.generate import GENERATE_PATH, GenerateEndpoint
from geserve.http.infer import INFER_PATH, InferEndpoint, send_response
from geserve.http.openapi import ROUTES, install_openapi, operation
from geserve.http.routes import build_routes
from geserve.restrictions import allowed
from geserve.settings import DEFAULT_MAX_INPUT_SIZE, HttpSettings, Restriction

# A request still running when the shutdown's deadline comes.
SHUT_DOWN_UNFINISHED = "the server is shutting down: the request did not finish within --exit-timeout-secs"


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
    if path.endswith(("/infer", "/generate", "/generate_stream")):
        return "inference"
    return "metadata"


class HttpApp:
    """The ASGI app uvicorn serves: infer and generate requests go straight to their endpoints, the rest to
    FastAPI. Restricted API groups are checked first, before any body is read."""

    def __init__(
        self,
        api: FastAPI,
        infer: InferEndpoint,
        generate: GenerateEndpoint,
        restrictions: Mapping[str, Restriction] | None = None,
    ) -> None:
        self.api = api
        self._infer = infer
        self._generate = generate
        self._restrictions = dict(restrictions or {})

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        try:
            await self._route(scope, receive, send)
        except asyncio.CancelledError:
            # uvicorn cancels what still runs once the shutdown's grace is spent (and says so once): the request gets
            # Triton's JSON error for a server that is shutting down, not uvicorn's plain 500 and a traceback each.
            if scope["type"] == "http":
                with contextlib.suppress(Exception):  # its answer had begun, or its client is gone
                    await send_response(send, 503, error_body(SHUT_DOWN_UNFINISHED))

    async def _route(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            if self._restrictions and not await self._permitted(scope, send):
                return
            match = INFER_PATH.match(scope["path"])
            if match is not None:
                await self._infer(scope, receive, send, match)
                return
            match = GENERATE_PATH.match(scope["path"])
            if match is not None:
                await self._generate(scope, receive, send, match)
                return
        await self.api(scope, receive, send)

    async def _permitted(self, scope: dict[str, Any], send: Any) -> bool:
        restriction = self._restrictions.get(api_group(scope["path"]))
        if restriction is None:
            return True
        headers = {key.decode("latin-1").lower(): value.decode("latin-1") for key, value in scope["headers"]}
        if allowed(restriction, headers.get):
            return True
        await send_response(send, 403, error_body(f"This API is restricted, expecting header '{restriction.key}'"))
        return False

    @staticmethod
    def reads_body_in_place(method: str, path: str) -> bool:
        """The requests whose bodies the connection may read straight into one buffer: infer's."""
        return method == "POST" and INFER_PATH.match(path) is not None


def create_app(service: InferenceAPI, settings: HttpSettings) -> HttpApp:
    limit = settings.max_input_size
    return HttpApp(
        create_api(service, limit, openapi=settings.openapi),
        InferEndpoint(service, limit, settings.max_json_size, settings.header_forward_pattern),
        GenerateEndpoint(service, limit, settings.max_json_size),
        settings.restrictions,
    )


async def _on_error(request: Request, error: Exception) -> Response:
    return error_response(*failure(error, f"{request.method} {request.url.path}"))


def create_api(service: InferenceAPI, max_input_size: int = DEFAULT_MAX_INPUT_SIZE, *, openapi: bool = True) -> FastAPI:
    """Every route but infer and generate, which HttpApp answers first: health, metadata, config, statistics and the
    control extensions; with `openapi`, the contract of all of them at /openapi.json, read at /docs."""
    # One handler, registered per class: what reaches Starlette's Exception handler is answered and then
    # re-raised into the server's log, which only unexpected errors should be.
    handlers = {GeserveError: _on_error, HTTPException: _on_error, Exception: _on_error}
    app = FastAPI(
        openapi_url="/openapi.json" if openapi else None,
        docs_url="/docs" if openapi else None,
        redoc_url=None,
        exception_handlers=handlers,  # type: ignore[arg-type]
    )
    routes: list[Route] = [*build_extension_routes(service, max_input_size), *build_routes(service)]
    for route in routes:
        for method in sorted(route.methods or ()):
            app.add_api_route(route.path, route.endpoint, methods=[method], **operation(method, route.path))
    # Documented here, answered by HttpApp before FastAPI sees them; a path that reaches these is no model's.
    for method, path in ROUTES:
        if path.endswith(("/infer", "/generate", "/generate_stream")):
            app.add_api_route(path, _not_found, methods=[method], **operation(method, path))
    install_openapi(app)
    return app


async def _not_found(request: Request) -> Response:
    raise HTTPException(404, "Not Found")
