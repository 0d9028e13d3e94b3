"""The metrics listener: GET /metrics on its own port, as Triton serves it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from prometheus_client.registry import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from geserve.metrics.exposition import CONTENT_TYPE, render


def create_metrics_app(registry: CollectorRegistry, refresh: Callable[[], Awaitable[None]]) -> Starlette:
    """GET /metrics: `refresh` reads the snapshot the registry's collectors then render."""

    async def metrics(request: Request) -> Response:
        await refresh()
        return Response(render(registry), media_type=None, headers={"Content-Type": CONTENT_TYPE})

    return Starlette(routes=[Route("/metrics", metrics, methods=["GET"])])
