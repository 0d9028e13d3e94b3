"""The grpc.aio server: Triton's message-size and keepalive options, started on the running loop."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import grpc

from geserve._generated import grpc_service_pb2, health_pb2
from geserve.core.restrictions import Restriction
from geserve.core.service import InferenceService
from geserve.grpc.decoding import add_service
from geserve.grpc.restrictions import RestrictionInterceptor
from geserve.grpc.servicer import HealthServicer, InferenceServicer

INT32_MAX = 2**31 - 1


@dataclass(frozen=True, slots=True)
class GrpcOptions:
    """Listener and HTTP/2 keepalive settings; defaults are tritonserver's."""

    address: str = "0.0.0.0"
    port: int = 8001
    keepalive_time_ms: int = 7_200_000
    keepalive_timeout_ms: int = 20_000
    keepalive_permit_without_calls: bool = False
    http2_max_pings_without_data: int = 2
    http2_min_recv_ping_interval_without_data_ms: int = 300_000
    http2_max_ping_strikes: int = 2
    # Triton's SO_REUSEPORT switch: off, so a second server on a taken port fails instead of splitting traffic.
    reuse_port: bool = False
    # GOAWAY after this long, so long-lived channels reconnect and spread over new replicas (0: never).
    max_connection_age_ms: int = 0
    max_connection_age_grace_ms: int = 0

    def channel_options(self) -> list[tuple[str, int]]:
        age = []
        if self.max_connection_age_ms > 0:
            age.append(("grpc.max_connection_age_ms", self.max_connection_age_ms))
            if self.max_connection_age_grace_ms > 0:
                age.append(("grpc.max_connection_age_grace_ms", self.max_connection_age_grace_ms))
        return [
            ("grpc.so_reuseport", int(self.reuse_port)),
            *age,
            ("grpc.max_send_message_length", INT32_MAX),
            ("grpc.max_receive_message_length", INT32_MAX),
            ("grpc.keepalive_time_ms", self.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", self.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", int(self.keepalive_permit_without_calls)),
            ("grpc.http2.max_pings_without_data", self.http2_max_pings_without_data),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", self.http2_min_recv_ping_interval_without_data_ms),
            ("grpc.http2.max_ping_strikes", self.http2_max_ping_strikes),
        ]


def create_server(
    service: InferenceService, options: GrpcOptions, restrictions: Mapping[str, Restriction] | None = None
) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server bound to its port (not started); returns it and the bound port."""
    interceptors = [RestrictionInterceptor(restrictions)] if restrictions else []
    server = grpc.aio.server(options=options.channel_options(), interceptors=interceptors)
    add_service(
        server, grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"], InferenceServicer(service)
    )
    add_service(server, health_pb2.DESCRIPTOR.services_by_name["Health"], HealthServicer(service))
    host = f"[{options.address}]" if ":" in options.address else options.address
    port = server.add_insecure_port(f"{host}:{options.port}")
    return server, port
