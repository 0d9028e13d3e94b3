"""One run's lifecycle in every layout: the startup preamble, the ports, and the shutdown plan a signal starts."""

# What SIGTERM (or SIGINT) does, in one place. `ShutdownPlan.begin` turns the settings into deadlines, and each
# layout carries out the same four steps against them:
#
#   1. drain      (at once)        readiness answers not ready; requests are still admitted and served, so load
#                                  balancers stop routing here; ATC compiles in progress stop (their loads fail).
#   2. refuse     (refuse_at)      --drain-delay-secs later the engine admits no new inference request.
#   3. front-ends (refuse_at)      HTTP and gRPC stop accepting; what is in flight finishes by `done_by`.
#   4. engine     (front-ends out) the workers finish their batches and stop, by `done_by`; the front-ends' grace
#                                  ends STOP_FLOOR_S before it, which the workers keep to unload (and a worker stuck
#                                  in its model is killed at the end of).
#
# `done_by` is refuse_at + --exit-timeout-secs, Triton's "timeout when exiting to wait for in-flight inferences to
# finish". A second signal kills the workers and exits 1 at once.
#
# One process (server.py) runs the engine host and a protocol host on one loop and takes each step itself. With
# several (multiprocess/), the supervisor sends DRAIN to every process at step 1 and REFUSE to the engine at step 2;
# each protocol process takes step 3 at its own `refuse_at`; the supervisor sends STOP to the engine once every
# protocol process has exited (step 4) and kills a protocol process still running at `kill_by`.

from __future__ import annotations

import enum
import logging
import socket
import time
from dataclasses import dataclass

from geserve.settings import ServerSettings, Settings
from geserve.sockets import GRPC_SERVICE, HTTP_SERVICE, METRICS_SERVICE, bind_socket, raise_descriptor_limit
from geserve.workers.runs import sweep_orphaned_segments

logger = logging.getLogger(__name__)

# Past `done_by`, before the supervisor kills a protocol process that has not exited: its front-ends' own
# shutdown (closing connections, the gRPC server's stop) runs after the grace.
KILL_MARGIN_S = 5.0
# What the workers keep of --exit-timeout-secs to exit on their own (unloading their models) however long what is in
# flight took: the front-ends' grace ends this much before `done_by`.
STOP_FLOOR_S = 1.0


class Role(enum.Enum):
    """What a process of the run does."""

    ENGINE = "engine"  # the models, the workers' pools, /metrics
    PROTOCOL = "protocol"  # HTTP and gRPC: each request's own work, in front of the engine


@dataclass(frozen=True, slots=True)
class Deadlines:
    """When each step of one shutdown is due, on time.monotonic()'s clock (the same in every process)."""

    refuse_at: float
    done_by: float
    kill_by: float

    def until_refuse(self) -> float:
        return max(self.refuse_at - time.monotonic(), 0.0)

    def left(self) -> float:
        """What is left of the time for what is in flight (and the workers' stop)."""
        return max(self.done_by - time.monotonic(), 0.0)

    def grace(self) -> float:
        """What the front-ends give what is in flight: what is left, but the workers' floor."""
        return max(self.left() - STOP_FLOOR_S, 0.0)


@dataclass(frozen=True, slots=True)
class ShutdownPlan:
    """The settings a shutdown's deadlines are computed from."""

    drain_s: float  # --drain-delay-secs
    exit_timeout_s: float  # --exit-timeout-secs

    @classmethod
    def of(cls, server: ServerSettings) -> ShutdownPlan:
        return cls(float(server.drain_delay_secs), float(server.exit_timeout_secs))

    def begin(self, *, drain: bool = True) -> Deadlines:
        """The deadlines of a shutdown that starts now; without `drain` (a front-end failed, the supervisor is gone:
        nobody routes here any more) step 2 is due at once."""
        refuse_at = time.monotonic() + (self.drain_s if drain else 0.0)
        done_by = refuse_at + self.exit_timeout_s
        return Deadlines(refuse_at, done_by, done_by + KILL_MARGIN_S)


def prepare_run(settings: Settings) -> None:
    """What every layout does before it binds a port: the descriptor limit, the settings' warnings, and the
    segments of killed servers removed."""
    raise_descriptor_limit()
    for warning in settings.server.warnings:
        logger.warning("%s", warning)
    orphans = sweep_orphaned_segments()
    if orphans:
        logger.warning("removed %d shared-memory segment(s) left by geserve servers that were killed", len(orphans))


@dataclass(slots=True)
class Ports:
    """The HTTP and metrics sockets of a run, bound (not listening) before any model loads: a taken port is a
    clear error at once, with nothing started that would need cleaning up."""

    http: socket.socket | None = None
    metrics: socket.socket | None = None

    def close(self) -> None:
        for sock in (self.http, self.metrics):
            if sock is not None:
                sock.close()
        self.http = self.metrics = None


def bind_ports(settings: Settings, *, check_grpc: bool) -> Ports | None:
    """Bind the HTTP and metrics ports, and with `check_grpc` try the gRPC port (bound and closed: the gRPC server
    binds it itself); None, with the error logged, when one is taken."""
    http, metrics, grpc = settings.http, settings.metrics, settings.grpc
    wanted = []
    if http.enabled:
        wanted.append((HTTP_SERVICE, http.address, http.port, http.reuse_port))
    if metrics.enabled:
        wanted.append((METRICS_SERVICE, metrics.address, metrics.port, False))
    if grpc.enabled and check_grpc:
        # A port another server holds is an error now; the protocol processes then bind it with SO_REUSEPORT,
        # which only processes of this server set, unless told to share.
        wanted.append((GRPC_SERVICE, grpc.address, grpc.port, grpc.reuse_port))
    ports = Ports()
    for name, address, port, reuse_port in wanted:
        try:
            sock = bind_socket(address, port, reuse_port)
        except OSError as error:
            logger.error("the %s cannot listen on %s:%d: %s", name, address, port, error.strerror)
            ports.close()
            return None
        if name == HTTP_SERVICE:
            ports.http = sock
        elif name == METRICS_SERVICE:
            ports.metrics = sock
        else:
            sock.close()
    return ports
