"""Listening sockets before anything listens on them, and the descriptor limit a server with many of them needs."""

from __future__ import annotations

import resource
import socket

HTTP_SERVICE = "HTTPService"
METRICS_SERVICE = "Metrics Service"
GRPC_SERVICE = "GRPCInferenceService"


def bind_socket(address: str, port: int, reuse_port: bool) -> socket.socket:
    """A TCP socket bound to the address (not yet listening, so connections are refused until it serves)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((address, port))
    except OSError:
        sock.close()
        raise
    return sock


def raise_descriptor_limit() -> int:
    """Raise the soft file-descriptor limit to the hard one, as servers with many sockets do; returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            return soft
        return hard
    return soft
