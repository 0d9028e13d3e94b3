"""Typed settings, one section per layer (server, http, grpc, metrics, repository, workers); built once by the CLI."""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

# Shared memory per worker process for a batch's inputs, and as much for its outputs.
DEFAULT_ARENA_BYTES = 16 << 20
DEFAULT_MAX_INPUT_SIZE = 1 << 26  # 64 MiB, Triton's --http-max-input-size
# JSON (an infer request's JSON header, a generate body) is parsed on a thread, which still holds the interpreter
# for each C call (the parse, the conversion to an array): at this size the longest held a liveness probe up 0.17 s
# under load on a 2-core host (`make chaos` large-json; 60 MiB held it 9.6 s); larger tensors go as binary data.
DEFAULT_MAX_JSON_SIZE = 1 << 22  # 4 MiB
# A request's line and headers together: Envoy's max_request_headers_kb is 60 KiB, nginx's
# large_client_header_buffers 4 x 8 KiB; tritonclient sends a few hundred bytes.
DEFAULT_MAX_HEADER_BYTES = 64 << 10
# Elements of one BYTES input: each becomes a Python bytes object (~40 bytes more than its data, and its decode
# time), so 32 MiB of 1-byte elements would cost 2 GB; a million costs ~60 MB.
DEFAULT_MAX_BYTES_ELEMENTS = 1 << 20
# Response bytes one HTTP connection may have queued, unsent: above any one response but a few.
DEFAULT_MAX_UNSENT_BYTES = 1 << 30
DEFAULT_QUANTILES = ((0.5, 0.05), (0.9, 0.01), (0.95, 0.001), (0.99, 0.001), (0.999, 0.001))
INT32_MAX = 2**31 - 1
DEFAULT_GRPC_STREAMS = 1024
DEFAULT_GRPC_INFLIGHT_RPCS = 4096


class ControlMode(enum.Enum):
    NONE = "none"  # load everything at start; the repository is not watched
    POLL = "poll"  # load everything, then follow changes every --repository-poll-secs
    EXPLICIT = "explicit"  # load --load-model at start; then the repository API decides


@dataclass(frozen=True, slots=True)
class Restriction:
    """A restricted API group: the header (gRPC metadata) key and value its calls must carry."""

    key: str  # header name, lower case as both HTTP/2 and ASGI deliver it
    value: str


@dataclass(frozen=True, slots=True)
class LoggingSettings:
    """Triton's log_file, log_info, log_warning, log_error, log_verbose_level and log_format at start."""

    log_file: str = ""
    log_info: bool = True
    log_warning: bool = True
    log_error: bool = True
    log_verbose_level: int = 0
    log_format: str = "default"

    @property
    def level(self) -> int:
        """The level worker processes log at."""
        if self.log_verbose_level > 0:
            return logging.DEBUG
        if self.log_info:
            return logging.INFO
        if self.log_warning:
            return logging.WARNING
        if self.log_error:
            return logging.ERROR
        return logging.CRITICAL


# Each protocol process's (the one process's) request arena: room for 64 requests of a 600 KB image at once.
DEFAULT_REQUEST_ARENA_BYTES = 64 << 20
DEFAULT_CLIENT_SHM_REGIONS = 4096
DEFAULT_CLIENT_SHM_BYTES = 64 << 30  # 64 GiB


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """The server as a whole: identity, readiness, shutdown, logging, tracing, client shared memory."""

    server_id: str = "triton"
    strict_readiness: bool = True
    exit_on_error: bool = True
    exit_timeout_secs: int = 30
    drain_delay_secs: int = 0
    max_bytes_elements: int = DEFAULT_MAX_BYTES_ELEMENTS  # elements of one BYTES input, over every protocol
    request_arena_bytes: int = DEFAULT_REQUEST_ARENA_BYTES  # where a process's requests' inputs are placed
    # 1: one process does everything; N >= 2: a supervisor, N protocol processes and one engine.
    frontend_processes: int = 1
    # A protocol process whose event loop has not answered the supervisor's ping for this long is killed and
    # replaced (0: never); uvicorn's --timeout-worker-healthcheck for its workers.
    protocol_healthcheck_secs: float = 10.0
    warnings: tuple[str, ...] = ()  # about flags accepted but not honoured, logged at start
    allow_client_shm: bool = False
    # Each registered region holds a file descriptor: without a cap, clients exhaust them and every new
    # connection, model load and worker fails (19,967 regions did under a 20,000 descriptor limit).
    max_client_shm_regions: int = DEFAULT_CLIENT_SHM_REGIONS
    max_client_shm_bytes: int = DEFAULT_CLIENT_SHM_BYTES  # the sum of the registered regions' byte sizes
    response_cache_bytes: int = 0  # the local response cache's size (--cache-config local,size=N); 0: no cache
    logging: LoggingSettings = field(default_factory=LoggingSettings)
    trace: Mapping[str, str | list[str]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class HttpSettings:
    """The HTTP listener and what one client connection may hold."""

    enabled: bool = True
    address: str = "0.0.0.0"
    port: int = 8000
    reuse_port: bool = False
    max_input_size: int = DEFAULT_MAX_INPUT_SIZE
    max_json_size: int = DEFAULT_MAX_JSON_SIZE  # --http-max-json-size
    header_timeout_s: float = 30.0  # first byte of a request to the end of its headers
    body_timeout_s: float = 60.0  # longest silence while a request body is arriving
    keep_alive_s: int = 5  # an idle connection (a new one, or between requests) is closed after this
    max_connections: int = 0  # 0: half the file-descriptor limit
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES  # a request's line and headers together; past it, 431
    send_timeout_s: float = 60.0  # longest a response may wait, unread by its client, before the connection closes
    max_unsent_bytes: int = DEFAULT_MAX_UNSENT_BYTES  # response bytes one connection may have waiting to be sent
    restrictions: Mapping[str, Restriction] = field(default_factory=dict)
    openapi: bool = True  # --http-openapi: serve /openapi.json and /docs
    header_forward_pattern: str = ""  # --http-header-forward-pattern: headers passed on as request parameters


@dataclass(frozen=True, slots=True)
class GrpcTls:
    """TLS for the gRPC listener (--grpc-use-ssl), its PEM files read at start: the server's key and certificate
    and, for --grpc-use-ssl-mutual, the root certificates client certificates must chain to (required then)."""

    key: bytes
    certificate: bytes
    root_certificates: bytes | None = None
    mutual: bool = False


@dataclass(frozen=True, slots=True)
class GrpcSettings:
    """The gRPC listener and its HTTP/2 keepalive settings; defaults are tritonserver's."""

    enabled: bool = True
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
    restrictions: Mapping[str, Restriction] = field(default_factory=dict)
    # What one client may hold. Triton fixes the message size at INT32_MAX and caps none of the others; a message
    # costs about twice its size while it is decoded, so an operator who knows the largest tensor lowers it.
    max_message_bytes: int = INT32_MAX
    max_concurrent_streams: int = DEFAULT_GRPC_STREAMS  # per connection: HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS
    max_inflight_rpcs: int = DEFAULT_GRPC_INFLIGHT_RPCS  # per process: past it, RESOURCE_EXHAUSTED at once
    max_connections: int = 0  # per process; 0: a quarter of the file-descriptor limit
    tls: GrpcTls | None = None  # None: plain gRPC
    header_forward_pattern: str = ""  # --grpc-header-forward-pattern: metadata passed on as request parameters

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
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_concurrent_streams", self.max_concurrent_streams),
            ("grpc.keepalive_time_ms", self.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", self.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", int(self.keepalive_permit_without_calls)),
            ("grpc.http2.max_pings_without_data", self.http2_max_pings_without_data),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", self.http2_min_recv_ping_interval_without_data_ms),
            ("grpc.http2.max_ping_strikes", self.http2_max_ping_strikes),
        ]


@dataclass(frozen=True, slots=True)
class MetricsSettings:
    """The metrics listener and Triton's metrics settings; latency counters on, summaries and histograms off."""

    enabled: bool = True
    address: str = "0.0.0.0"
    port: int = 8002
    counter_latencies: bool = True
    summary_latencies: bool = False
    summary_quantiles: tuple[tuple[float, float], ...] = DEFAULT_QUANTILES
    histogram_latencies: bool = False
    interval_ms: int = 2000
    cpu_metrics: bool = True
    gpu_metrics: bool = True  # accelerators (NPUs) under Triton's nv_gpu_* names


@dataclass(frozen=True, slots=True)
class RepositorySettings:
    """Where the models are and which of them load when: --model-control-mode, --load-model, polling."""

    paths: tuple[Path, ...] = ()
    remotes: tuple[str, ...] = ()  # repositories in object storage (s3:// URLs), copied into a local folder
    control_mode: ControlMode = ControlMode.NONE
    startup_models: tuple[str, ...] = ()
    poll_secs: float = 15.0
    config_name: str = ""  # --model-config-name: configs/<name>.pbtxt over config.pbtxt where a model has it


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """How model instances are placed and run."""

    process_workers: bool = True  # False runs backends on threads of this process (tests, debugging)
    auto_complete: bool = True  # complete configs from the model files
    log_level: int = logging.INFO
    log_format: str = "default"  # --log-format, which the workers' lines take too
    log_file: str = ""  # --log-file, which the workers append to; empty: standard error
    arena_bytes: int = DEFAULT_ARENA_BYTES  # per worker, each way
    pipeline_depth: int | None = None  # batches a worker holds at once; None: what its backend does best
    device_ids: tuple[int, ...] = ()  # accelerators (NPUs) instances may use
    stop_timeout_s: float = 30.0
    npu_mode: str = "auto"  # --npu: auto | required | off, for `ge` models (workers/npu_mode.py)
    model_cache_dir: Path | None = None  # where `.om` files compiled from model.onnx live (None: the user cache)
    # ATC runs at once (--model-compile-concurrency), on threads of their own: never the shared default pool.
    compile_concurrency: int = 1
    atc_python: str | None = None  # --atc-python: the interpreter ATC's operator compiler runs in
    rate_limit: str = "off"  # --rate-limit: off, or execution_count (instances run with their resources only)
    rate_limit_resources: tuple[tuple[str, int, int], ...] = ()  # --rate-limit-resource: (name, device, count)


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything the command line decides; defaults are tritonserver's."""

    server: ServerSettings = field(default_factory=ServerSettings)
    http: HttpSettings = field(default_factory=HttpSettings)
    grpc: GrpcSettings = field(default_factory=GrpcSettings)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)
    repository: RepositorySettings = field(default_factory=RepositorySettings)
    workers: WorkerSettings = field(default_factory=WorkerSettings)
