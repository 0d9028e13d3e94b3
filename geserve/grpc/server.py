"""The grpc.aio server: Triton's message-size and keepalive options, started on the running loop."""

from __future__ import annotations

import grpc

from geserve._generated import grpc_service_pb2, health_pb2
from geserve.core.api import InferenceAPI
from geserve.grpc.decoding import add_service
from geserve.grpc.restrictions import RestrictionInterceptor
from geserve.grpc.servicer import HealthServicer, InferenceServicer
from geserve.settings import GrpcSettings


def create_server(service: InferenceAPI, settings: GrpcSettings) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server bound to its port (not started); returns it and the bound port."""
    interceptors = [RestrictionInterceptor(settings.restrictions)] if settings.restrictions else []
    server = grpc.aio.server(options=settings.channel_options(), interceptors=interceptors)
    add_service(
        server, grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"], InferenceServicer(service)
    )
    add_service(server, health_pb2.DESCRIPTOR.services_by_name["Health"], HealthServicer(service))
    host = f"[{settings.address}]" if ":" in settings.address else settings.address
    port = server.add_insecure_port(f"{host}:{settings.port}")
    return server, port
