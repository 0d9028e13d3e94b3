"""tritonserver's flags as geserve accepts them: names, types, defaults and help, in one argparse parser."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from geserve import __version__, trace_flags, triton_flags
from geserve.core.log_control import FORMATS
from geserve.restrictions import GROUPS
from geserve.settings import (
    DEFAULT_ARENA_BYTES,
    DEFAULT_CLIENT_SHM_BYTES,
    DEFAULT_CLIENT_SHM_REGIONS,
    DEFAULT_MAX_BYTES_ELEMENTS,
    DEFAULT_MAX_INPUT_SIZE,
    DEFAULT_MAX_JSON_SIZE,
    ControlMode,
    GrpcSettings,
    HttpSettings,
)
from geserve.workers.devices import parse_device_ids

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got '{text}'")


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in [0, 65535], got {port}")
    return port


def _device_ids(text: str) -> tuple[int, ...]:
    try:
        return parse_device_ids(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _interpreter(text: str) -> str:
    """A Python interpreter that exists and can be run."""
    path = Path(text).absolute()
    if not path.is_file() or not os.access(path, os.X_OK):
        raise argparse.ArgumentTypeError(f"'{text}' is not an interpreter this server can run")
    return str(path)


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _processes(text: str) -> int:
    """A process count, or 0 for `auto` (chosen from the cores once the devices are known)."""
    if text == "auto":
        return 0
    try:
        return _positive(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got '{text}'") from None


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def _config_name(value: str) -> str:
    """--model-config-name: a file name (Triton refuses an empty one)."""
    if not value:
        raise argparse.ArgumentTypeError("empty argument for --model-config-name")
    if "/" in value or value in (".", ".."):
        raise argparse.ArgumentTypeError(f"'{value}' is not a file name under a model's configs/ folder")
    return value


def _boolean(group: argparse._ArgumentGroup, name: str, default: bool, help_text: str) -> None:
    group.add_argument(
        name,
        type=_bool,
        nargs="?",
        const=True,
        default=default,
        metavar="BOOL",
        help=f"{help_text} (default: {str(default).lower()})",
    )


# The offline tools `geserve COMMAND` runs instead of a server: name -> what it does.
COMMANDS = {
    "inspect": "FILE.om: what a compiled model declares, and a config.pbtxt that serves it",
    "check": "--model-repository DIR: every model checked offline, one line per problem",
    "compile": "--model-repository DIR: compile every `ge` model's model.onnx with ATC into the cache",
}


def build_parser(prog: str = "geserve") -> argparse.ArgumentParser:
    """The server's flags; `prog` is the name it was started by (`tritonserver` too), which usage and errors say.
    Each group's flags come from a function of their own; the groups and their order are what `--help` shows."""
    parser = _bare_parser(prog)
    # --help has always listed the lifecycle, worker and NPU flags under "model repository": kept so.
    group = parser.add_argument_group("model repository")
    _add_repository_flags(group)
    _add_lifecycle_flags(group)
    _add_worker_flags(group)
    _add_npu_flags(group)
    _add_server_id_flag(group)
    group = parser.add_argument_group("model control")
    _add_model_control_flags(group)
    _add_client_memory_flags(group)
    group = parser.add_argument_group("HTTP")
    _add_http_flags(group)
    _add_http_limit_flags(group)
    _add_grpc_flags(parser.add_argument_group("gRPC"))
    _add_metrics_flags(parser.add_argument_group("metrics"))
    _add_cache_flags(parser.add_argument_group("response cache"))
    group = parser.add_argument_group("logging")
    _add_logging_flags(group)
    trace_flags.add_flags(group)
    triton_flags.add_flags(parser)
    return parser


def _bare_parser(prog: str) -> argparse.ArgumentParser:
    """The parser with its description, the offline commands in its epilog, and --version."""
    width = max(len(name) for name in COMMANDS) + 2
    commands = "\n".join(f"  {prog} {name.ljust(width)}{text}" for name, text in COMMANDS.items())
    parser = argparse.ArgumentParser(
        prog=prog,
        description="A Triton-compatible (KServe v2) inference server. Boolean flags take true/false\n"
        "(`--strict-readiness=false`); a bare boolean flag means true. Every flag can also be set\n"
        "by the variable GESERVE_<FLAG> (GESERVE_HTTP_PORT=9000; a repeatable flag's values as a\n"
        'JSON list: GESERVE_LOAD_MODEL=\'["a", "b"]\'); the command line wins.',
        epilog=f"commands (offline tools: they start no server):\n{commands}\n\n"
        f"`{prog} COMMAND --help` shows a command's flags.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"geserve {__version__}")
    return parser


def _add_repository_flags(group: argparse._ArgumentGroup) -> None:
    """Where the models are, how their configs are completed, and what a failed load means."""
    group.add_argument(
        "--model-repository",
        "--model-store",
        dest="model_repositories",
        action="append",
        required=True,
        metavar="PATH",
        help="a model repository: a folder, or s3://[host:port/]bucket/path; repeat for several",
    )
    group.add_argument(
        "--disable-auto-complete-config",
        action="store_true",
        help="do not complete configs from the model files",
    )
    group.add_argument(
        "--strict-model-config",
        type=_bool,
        nargs="?",
        const=True,
        default=None,
        metavar="BOOL",
        help="deprecated: true is --disable-auto-complete-config",
    )
    _boolean(group, "--exit-on-error", True, "exit when any model fails to load")
    _boolean(group, "--strict-readiness", True, "ready only while every model is ready")


def _add_lifecycle_flags(group: argparse._ArgumentGroup) -> None:
    """How the server stops, and how many processes it runs as."""
    group.add_argument(
        "--exit-timeout-secs",
        type=int,
        default=30,
        metavar="SECONDS",
        help="how long shutdown waits for in-flight requests and workers (default: 30)",
    )
    group.add_argument(
        "--drain-delay-secs",
        type=_non_negative,
        default=0,
        metavar="SECONDS",
        help="on SIGTERM, report not ready at once but keep accepting and serving this long before stopping, "
        "while load balancers take the server out of rotation (default: 0)",
    )
    group.add_argument(
        "--frontend-processes",
        type=_processes,
        default=1,
        metavar="N|auto",
        help="1: one process serves everything; N >= 2: a supervisor, N protocol processes doing the HTTP and "
        "gRPC byte work and one engine owning the models, batching and workers; auto: from the usable cores "
        "(default: 1)",
    )
    group.add_argument(
        "--protocol-healthcheck-secs",
        type=_non_negative_float,
        default=10.0,
        metavar="SECONDS",
        help="with --frontend-processes N >= 2: a protocol process whose event loop does not answer the "
        "supervisor's ping (sent every second) for this long is killed and replaced; 0: never (default: 10)",
    )


def _non_negative_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not number >= 0 or number == float("inf"):
        raise argparse.ArgumentTypeError(f"{value!r} must be a finite number of seconds, 0 or more")
    return number


def _repeatable(group: argparse._ArgumentGroup, flag: str, metavar: str, help_text: str) -> None:
    """A flag given any number of times, its values collected in order (none by default)."""
    group.add_argument(flag, action="append", default=[], metavar=metavar, help=help_text)


def _rate_limit(value: str) -> str:
    """--rate-limit: off or execution_count, in any case (Triton lowercases it)."""
    lowered = value.lower()
    if lowered not in ("off", "execution_count"):
        raise argparse.ArgumentTypeError("invalid argument for --rate-limit")
    return lowered


def _add_worker_flags(group: argparse._ArgumentGroup) -> None:
    """The worker processes' shared memory, how many batches each holds at once, and the rate limiter."""
    group.add_argument(
        "--rate-limit",
        type=_rate_limit,
        default="off",
        metavar="off|execution_count",
        help="execution_count: an instance runs a batch only once it holds the resources its instance group's "
        "rate_limiter names, instances waiting in order of their priority, as Triton's rate limiter (default: off)",
    )
    _repeatable(
        group,
        "--rate-limit-resource",
        "NAME:COUNT[:DEVICE]",
        "with --rate-limit=execution_count, the copies of a resource (on DEVICE, else on each device; a global "
        "resource takes the largest count given for its name); by default the most any instance names; repeatable",
    )
    group.add_argument(
        "--worker-arena-size",
        type=_positive,
        default=DEFAULT_ARENA_BYTES,
        metavar="BYTES",
        help="shared memory per worker process for a batch's inputs, and as much for its outputs; larger "
        f"batches use a one-off segment (default: {DEFAULT_ARENA_BYTES})",
    )
    group.add_argument(
        "--worker-pipeline-depth",
        type=_positive,
        default=None,
        metavar="N",
        help="batches a worker process holds at once: one running and N-1 waiting behind it, each in its own "
        "pair of arenas (default: 2 for .om models, whose worker copies the next batch to the NPU while one "
        "runs; 1 for the others, where 2 formed smaller batches and lowered throughput)",
    )


def _add_npu_flags(group: argparse._ArgumentGroup) -> None:
    """Which NPUs instances use, and how `ge` models without an .om are served: compiled by ATC, or by ONNX Runtime."""
    group.add_argument(
        "--device-ids",
        type=_device_ids,
        default=None,
        metavar="IDS",
        help="logical NPU ids instances may use, e.g. 0,1, as acl.rt.set_device numbers them (default: 0..n-1 for "
        "the n devices ASCEND_RT_VISIBLE_DEVICES lists, else for the n /dev/davinciN chips, whatever their numbers)",
    )
    group.add_argument(
        "--npu",
        choices=("auto", "required", "off"),
        default="auto",
        help="`ge` models: auto runs them on the NPU, compiling a version's model.onnx with ATC when it has no .om, "
        "and serves model.onnx with ONNX Runtime only on a host without the Ascend driver (NPUs it cannot use, "
        "pyACL or atc missing fail the load, naming the fix); required fails every load that cannot run on an NPU; "
        "off serves every `ge` model that has a model.onnx with ONNX Runtime (default: auto)",
    )
    group.add_argument(
        "--model-cache-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="where .om files compiled from model.onnx are kept, keyed by the ONNX file, ATC options, chip and CANN "
        "version, so a restart does not recompile; may be shared by several servers (default: "
        "$XDG_CACHE_HOME/geserve/om, else ~/.cache/geserve/om)",
    )
    group.add_argument(
        "--atc-python",
        type=_interpreter,
        default=None,
        metavar="PATH",
        help="the Python interpreter ATC's operator compiler runs in, as the python3 first on ATC's PATH (default: "
        "the python3 on the host's PATH, geserve's own virtual environment left out: CANN needs numpy < 2, "
        "decorator, attrs, psutil, scipy and sympy there)",
    )
    group.add_argument(
        "--model-compile-concurrency",
        type=_positive,
        default=1,
        metavar="N",
        help="ATC compiles of model.onnx run at once, on threads of their own so that a compile never holds up "
        "requests; more wait their turn (default: 1, as ATC itself compiles on every core)",
    )


def _add_server_id_flag(group: argparse._ArgumentGroup) -> None:
    """The name server metadata reports."""
    group.add_argument(
        "--id", dest="server_id", default="triton", help="server name in server metadata (default: triton)"
    )


def _add_model_control_flags(group: argparse._ArgumentGroup) -> None:
    """Which models load at start, and how the repository is followed afterwards."""
    group.add_argument(
        "--model-control-mode",
        choices=[mode.value for mode in ControlMode],
        default="none",
        help="none: load everything at start; poll: also follow repository changes; explicit: load "
        "--load-model at start, then through the repository API (default: none)",
    )
    _repeatable(
        group,
        "--load-model",
        "NAME",
        "with --model-control-mode=explicit, a model to load at start; repeatable; '*' loads all",
    )
    group.add_argument(
        "--repository-poll-secs",
        type=_positive,
        default=15,
        metavar="SECONDS",
        help="with --model-control-mode=poll, seconds between repository scans (default: 15)",
    )
    group.add_argument(
        "--model-config-name",
        type=_config_name,
        default=None,  # argparse would check a default string with `type`
        metavar="NAME",
        help="read each model's configs/NAME.pbtxt where it has one, config.pbtxt otherwise (Triton's per-host "
        "configs)",
    )


def _add_client_memory_flags(group: argparse._ArgumentGroup) -> None:
    """Client shared-memory regions and BYTES inputs: what clients may hand the server."""
    _boolean(group, "--allow-client-shm", False, "let clients register system shared-memory regions for tensors")
    group.add_argument(
        "--max-bytes-tensor-elements",
        type=_positive,
        default=DEFAULT_MAX_BYTES_ELEMENTS,
        metavar="N",
        help="elements one BYTES input may have, over HTTP and gRPC; past it the request is refused "
        f"(default: {DEFAULT_MAX_BYTES_ELEMENTS})",
    )
    group.add_argument(
        "--max-client-shm-regions",
        type=_positive,
        default=DEFAULT_CLIENT_SHM_REGIONS,
        metavar="COUNT",
        help="most shared-memory regions registered at once; each holds a file descriptor "
        f"(default: {DEFAULT_CLIENT_SHM_REGIONS})",
    )
    group.add_argument(
        "--max-client-shm-bytes",
        type=_positive,
        default=DEFAULT_CLIENT_SHM_BYTES,
        metavar="BYTES",
        help=f"most bytes the registered shared-memory regions span together (default: {DEFAULT_CLIENT_SHM_BYTES})",
    )


def _add_http_flags(group: argparse._ArgumentGroup) -> None:
    """The HTTP/REST front-end: whether it serves, where, which API groups it restricts, and its largest body."""
    _boolean(group, "--allow-http", True, "serve HTTP/REST")
    _boolean(
        group,
        "--http-openapi",
        True,
        "serve the REST API's OpenAPI document at /openapi.json and its browsable form at /docs (metadata group of "
        "--http-restricted-api)",
    )
    _repeatable(
        group,
        "--http-restricted-api",
        "APIS:KEY=VALUE",
        "only requests with header KEY: VALUE may use these API groups (comma-separated: "
        f"{', '.join(GROUPS)}); repeatable",
    )
    group.add_argument(
        "--http-header-forward-pattern",
        default="",
        metavar="REGEX",
        help="infer request headers whose name the pattern matches (anywhere, ignoring case) reach the model as "
        "request parameters, as Triton's",
    )
    group.add_argument("--http-address", default="0.0.0.0", help="HTTP bind address (default: 0.0.0.0)")
    _boolean(group, "--reuse-http-port", False, "let several servers listen on the HTTP port (SO_REUSEPORT)")
    group.add_argument("--http-port", type=_port, default=8000, help="HTTP port (default: 8000)")
    group.add_argument(
        "--http-max-input-size",
        type=_positive,
        default=DEFAULT_MAX_INPUT_SIZE,
        metavar="BYTES",
        help=f"largest request body, also after decompression (default: {DEFAULT_MAX_INPUT_SIZE})",
    )
    group.add_argument(
        "--http-max-json-size",
        type=_positive,
        default=DEFAULT_MAX_JSON_SIZE,
        metavar="BYTES",
        help="largest JSON an infer request's header or a generate body may hold: JSON tensor data is parsed into "
        "Python objects, which a large body would hold the server up with; send large tensors as binary data "
        f"(default: {DEFAULT_MAX_JSON_SIZE})",
    )


def _add_http_limit_flags(group: argparse._ArgumentGroup) -> None:
    """What one HTTP connection may take of the server: time for its head and body, unread responses, the count."""
    limits = HttpSettings()
    group.add_argument(
        "--http-header-timeout-secs",
        type=_positive_float,
        default=limits.header_timeout_s,
        metavar="SECONDS",
        help="time from a request's first byte to the end of its headers; past it the answer is 408 and the "
        f"connection closes (default: {limits.header_timeout_s:g})",
    )
    group.add_argument(
        "--http-body-timeout-secs",
        type=_positive_float,
        default=limits.body_timeout_s,
        metavar="SECONDS",
        help=f"longest silence while a request body arrives; past it, 408 (default: {limits.body_timeout_s:g})",
    )
    group.add_argument(
        "--http-keepalive-timeout-secs",
        type=_positive,
        default=limits.keep_alive_s,
        metavar="SECONDS",
        help=f"an idle connection is closed after this (default: {limits.keep_alive_s})",
    )
    group.add_argument(
        "--http-max-header-size",
        type=_positive,
        default=limits.max_header_bytes,
        metavar="BYTES",
        help="largest request line and headers together; past it the answer is 431 and the connection closes "
        f"(default: {limits.max_header_bytes})",
    )
    group.add_argument(
        "--http-send-timeout-secs",
        type=_positive_float,
        default=limits.send_timeout_s,
        metavar="SECONDS",
        help="longest a client may leave its response unread (nothing of it taken); past it the connection "
        f"closes (default: {limits.send_timeout_s:g})",
    )
    group.add_argument(
        "--http-max-unsent-bytes",
        type=_positive,
        default=limits.max_unsent_bytes,
        metavar="BYTES",
        help="response bytes one connection may have waiting to be sent; past it the connection closes "
        f"(default: {limits.max_unsent_bytes})",
    )
    group.add_argument(
        "--http-max-connections",
        type=_positive,
        default=None,
        metavar="N",
        help="open HTTP connections at most; past it a new connection is answered 503 and closed (default: half "
        "the file-descriptor limit, which geserve raises to its hard limit)",
    )


def _add_grpc_flags(group: argparse._ArgumentGroup) -> None:
    """The gRPC front-end: address, restrictions, keepalive, and its limits."""
    _boolean(group, "--allow-grpc", True, "serve gRPC")
    _repeatable(
        group,
        "--grpc-restricted-protocol",
        "PROTOCOLS:KEY=VALUE",
        "only calls with metadata triton-grpc-protocol-KEY: VALUE may use these API groups; repeatable",
    )
    group.add_argument("--grpc-address", default="0.0.0.0", help="gRPC bind address (default: 0.0.0.0)")
    group.add_argument("--grpc-port", type=_port, default=8001, help="gRPC port (default: 8001)")
    defaults = GrpcSettings()
    for flag, default, meaning in (
        ("--grpc-keepalive-time", defaults.keepalive_time_ms, "ms between keepalive pings"),
        ("--grpc-keepalive-timeout", defaults.keepalive_timeout_ms, "ms to wait for a keepalive ping's answer"),
        ("--grpc-http2-max-pings-without-data", defaults.http2_max_pings_without_data, "pings sent without data"),
        (
            "--grpc-http2-min-recv-ping-interval-without-data",
            defaults.http2_min_recv_ping_interval_without_data_ms,
            "least ms between pings received without data",
        ),
        ("--grpc-http2-max-ping-strikes", defaults.http2_max_ping_strikes, "bad pings tolerated before closing"),
    ):
        group.add_argument(flag, type=int, default=default, metavar="N", help=f"{meaning} (default: {default})")
    _boolean(group, "--grpc-keepalive-permit-without-calls", False, "allow keepalive pings with no call open")
    _boolean(group, "--reuse-grpc-port", False, "let several servers listen on the gRPC port (SO_REUSEPORT)")
    group.add_argument(
        "--grpc-header-forward-pattern",
        default="",
        metavar="REGEX",
        help="call metadata whose key the pattern matches (anywhere, ignoring case) reaches the model as request "
        "parameters, as Triton's",
    )
    _boolean(group, "--grpc-use-ssl", False, "serve gRPC over TLS (needs --grpc-server-cert and --grpc-server-key)")
    _boolean(
        group,
        "--grpc-use-ssl-mutual",
        False,
        "serve gRPC over mutual TLS: clients present certificates that chain to --grpc-root-cert (implies "
        "--grpc-use-ssl)",
    )
    for flag, meaning in (
        ("--grpc-server-cert", "the server's certificate chain (PEM), with --grpc-use-ssl"),
        ("--grpc-server-key", "the server's private key (PEM), with --grpc-use-ssl"),
        ("--grpc-root-cert", "the root certificates (PEM) client certificates must chain to, with mutual TLS"),
    ):
        group.add_argument(flag, default="", metavar="PATH", help=meaning)
    for flag, meaning in (
        ("--grpc-max-connection-age", "ms a connection may live before the server asks the client to reconnect"),
        ("--grpc-max-connection-age-grace", "ms a connection past its age has to finish its calls"),
    ):
        group.add_argument(flag, type=_non_negative, default=0, metavar="MS", help=f"{meaning} (default: unset)")
    for flag, default, meaning in (
        ("--grpc-max-message-size", defaults.max_message_bytes, "largest message a call may send, in bytes"),
        ("--grpc-max-concurrent-streams", defaults.max_concurrent_streams, "calls open at once on one connection"),
        ("--grpc-max-inflight-rpcs", defaults.max_inflight_rpcs, "calls in progress at once (per process)"),
    ):
        group.add_argument(flag, type=_positive, default=default, metavar="N", help=f"{meaning} (default: {default})")
    group.add_argument(
        "--grpc-max-connections",
        type=_positive,
        default=None,
        metavar="N",
        help="open gRPC connections at most; past it a new one is closed (default: a quarter of the file-descriptor "
        "limit)",
    )


def _add_metrics_flags(group: argparse._ArgumentGroup) -> None:
    """The Prometheus metrics endpoint and what it publishes."""
    _boolean(group, "--allow-metrics", True, "serve Prometheus metrics")
    group.add_argument("--metrics-address", default="", help="metrics bind address (default: the HTTP address)")
    group.add_argument("--metrics-port", type=_port, default=8002, help="metrics port (default: 8002)")
    _repeatable(
        group,
        "--metrics-config",
        "KEY=VALUE",
        "counter_latencies, summary_latencies, summary_quantiles (q:e,...) or histogram_latencies; repeatable",
    )
    group.add_argument(
        "--metrics-interval-ms",
        type=_positive,
        default=2000,
        metavar="MS",
        help="how often CPU utilization is refreshed (default: 2000)",
    )
    _boolean(group, "--allow-cpu-metrics", True, "publish nv_cpu_* metrics")
    _boolean(group, "--allow-gpu-metrics", True, 'NPU memory and utilization as nv_gpu_* (gpu_uuid="NPU-<id>")')


def _add_cache_flags(group: argparse._ArgumentGroup) -> None:
    """The response cache."""
    _repeatable(
        group,
        "--cache-config",
        "local,size=BYTES",
        "a response cache of this many bytes for the models whose config sets response_cache { enable: true }, "
        "shared by all of them, least recently used entries evicted first (default: no cache)",
    )
    _repeatable(
        group,
        "--response-cache-byte-size",
        "BYTES",
        "deprecated: --cache-config=local,size=BYTES",
    )


def _add_logging_flags(group: argparse._ArgumentGroup) -> None:
    """Log levels, format and file (trace flags join this group: trace_flags)."""
    group.add_argument(
        "--log-verbose",
        type=int,
        default=0,
        metavar="LEVEL",
        help="verbose logging level; >0 logs debug details (default: 0)",
    )
    _boolean(group, "--log-info", True, "log informational messages")
    _boolean(group, "--log-warning", True, "log warnings")
    _boolean(group, "--log-error", True, "log errors")
    group.add_argument(
        "--log-format",
        choices=list(FORMATS),
        default="default",
        help="log line format: default or ISO8601 (Triton's), or json: one JSON object per line (time, level, logger, "
        "message, and a request's model, version and request_id), in every process of the server (default: default)",
    )
    group.add_argument(
        "--log-file",
        default="",
        metavar="PATH",
        help="log to this file instead of the console; every process of the server, workers included, appends to it",
    )
