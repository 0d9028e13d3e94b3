"""The grpc.aio server: Triton's message-size and keepalive options and geserve's caps, started on the running loop."""

from __future__ import annotations

import resource

import grpc

from geserve._generated import grpc_service_pb2, health_pb2
from geserve.core.api import InferenceAPI
from geserve.grpc.decoding import add_service
from geserve.grpc.restrictions import RestrictionInterceptor
from geserve.grpc.servicer import HealthServicer, InferenceServicer
from geserve.settings import GrpcSettings


def create_server(
    service: InferenceAPI, settings: GrpcSettings, *, trace_context: bool = False
) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server bound to its port (not started); returns it and the bound port. With `trace_context`
    (trace mode opentelemetry), ModelInfer reads the client's W3C trace context from the call's metadata."""
    interceptors = [RestrictionInterceptor(settings.restrictions)] if settings.restrictions else []
    # A connection past the cap is closed as it is accepted (gRPC's resource quota); a call past
    # --grpc-max-inflight-rpcs is answered RESOURCE_EXHAUSTED before it is read.
    connections = ("grpc.max_allowed_incoming_connections", settings.max_connections or connection_limit())
    server = grpc.aio.server(
        options=[*settings.channel_options(), connections],
        interceptors=interceptors,
        maximum_concurrent_rpcs=settings.max_inflight_rpcs,
    )
    servicer = InferenceServicer(
        service, trace_context=trace_context, header_forward_pattern=settings.header_forward_pattern
    )
    add_service(server, grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"], servicer)
    add_service(server, health_pb2.DESCRIPTOR.services_by_name["Health"], HealthServicer(service))
    host = f"[{settings.address}]" if ":" in settings.address else settings.address
    address = f"{host}:{settings.port}"
    tls = settings.tls
    if tls is None:
        return server, server.add_insecure_port(address)
    # As Triton's SslServerCredentialsOptions: the key and certificate pair, the root certificates, and with mutual
    # TLS a client certificate requested, required and verified.
    credentials = grpc.ssl_server_credentials(
        [(tls.key, tls.certificate)], root_certificates=tls.root_certificates, require_client_auth=tls.mutual
    )
    return server, server.add_secure_port(address, credentials)


def connection_limit() -> int:
    """A quarter of the file-descriptor limit (geserve raises it to the hard one at start): HTTP's connections may
    take half, and the rest stays for models, workers and client shared-memory regions."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(soft // 4, 1) if soft != resource.RLIM_INFINITY else 1 << 15
