"""tritonserver-style command line -> Settings, and the `geserve` entry point."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from geserve import env_flags, log_records, trace_flags, triton_flags
from geserve.cache_config import parse_cache_flags
from geserve.core.log_control import LogControl
from geserve.core.trace import TraceController
from geserve.errors import GeserveError, InvalidArgumentError
from geserve.event_loop import loop_factory
from geserve.flags import COMMANDS, build_parser
from geserve.frontdoor import header_forwarding
from geserve.memory import bound_arenas, keep_freed_memory
from geserve.metrics import config as metrics_config
from geserve.repository import remote
from geserve.restrictions import parse_restrictions
from geserve.settings import (
    ControlMode,
    GrpcSettings,
    GrpcTls,
    HttpSettings,
    LoggingSettings,
    MetricsSettings,
    RepositorySettings,
    ServerSettings,
    Settings,
    WorkerSettings,
)
from geserve.workers import rate_limiter
from geserve.workers.devices import discover_devices


def bind_address(text: str, flag: str) -> str:
    """An address as the socket binds it: Triton's `ipv6:[::1]` (also `ipv6:::1`, `ipv4:127.0.0.1`) is the bare
    host, as tritonserver's HTTP server reads the same prefixes."""
    if text.startswith("ipv4:"):
        return text.removeprefix("ipv4:")
    bracketed = text.startswith("[") and text.endswith("]")  # `[::1]`, as tritonserver's gRPC address takes it
    if not text.startswith("ipv6:") and not bracketed:
        return text
    host = text.removeprefix("ipv6:")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        raise InvalidArgumentError(f"{flag}={text} is not an IPv6 address; expected e.g. ipv6:[::1]") from None
    return host


def auto_frontend_processes() -> int:
    """`--frontend-processes=auto`: one protocol process per two usable cores, up to 8, and one process
    (everything in it) where only one core is usable."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return 1 if cores < 2 else min(max(cores // 2, 2), 8)


def _given(args: argparse.Namespace, flag: str) -> str:
    """A string flag's value, by the flag's name."""
    value: str = getattr(args, flag[2:].replace("-", "_"))
    return value


def _grpc_tls(args: argparse.Namespace) -> GrpcTls | None:
    """The gRPC listener's TLS, its files read now: a file missing or unreadable stops startup naming its flag (Triton
    would serve with an empty one). --grpc-use-ssl-mutual implies --grpc-use-ssl, as in Triton."""
    mutual = bool(args.grpc_use_ssl_mutual)
    if not (args.grpc_use_ssl or mutual):
        return None
    needed = ["--grpc-server-cert", "--grpc-server-key", *(["--grpc-root-cert"] if mutual else [])]
    missing = [flag for flag in needed if not _given(args, flag)]
    if missing:
        mode = "--grpc-use-ssl-mutual" if mutual else "--grpc-use-ssl"
        raise InvalidArgumentError(f"{mode} needs {' and '.join(missing)}")

    def read(flag: str) -> bytes:
        path = _given(args, flag)
        try:
            content = Path(path).read_bytes()
        except OSError as error:
            raise InvalidArgumentError(f"{flag}: cannot read '{path}': {error.strerror or error}") from None
        if b"-----BEGIN " not in content:
            raise InvalidArgumentError(f"{flag}: '{path}' holds no PEM block")
        return content

    root = read("--grpc-root-cert") if mutual or args.grpc_root_cert else None
    return GrpcTls(read("--grpc-server-key"), read("--grpc-server-cert"), root, mutual)


def parse_settings(
    argv: Sequence[str] | None = None, prog: str = "geserve", environ: Mapping[str, str] | None = None
) -> Settings:
    """The settings of the command line `argv` (by default the process's) and of the GESERVE_<FLAG> variables of
    `environ` (by default the process's), the command line winning."""
    parser = build_parser(prog)
    arguments = list(sys.argv[1:] if argv is None else argv)
    try:
        arguments = env_flags.environment_argv(
            lambda: build_parser(prog), arguments, os.environ if environ is None else environ
        )
    except GeserveError as error:
        parser.error(error.message)
    args, extras = parser.parse_known_args(arguments)
    if extras:
        parser.error(triton_flags.unrecognized(extras))
    try:
        for flag in ("http_address", "grpc_address", "metrics_address"):
            setattr(args, flag, bind_address(getattr(args, flag), f"--{flag.replace('_', '-')}"))
        latency = metrics_config.parse_entries(args.metrics_config)
        http_restrictions = parse_restrictions(args.http_restricted_api, "--http-restricted-api")
        grpc_restrictions = parse_restrictions(args.grpc_restricted_protocol, "--grpc-restricted-protocol")
        trace_settings, trace_warnings = trace_flags.trace_settings(args)
        TraceController(trace_settings)  # checks the values
        cache_bytes, cache_warnings = parse_cache_flags(args.cache_config, args.response_cache_byte_size)
        grpc_tls = _grpc_tls(args)
        rate_limit_resources = tuple(rate_limiter.parse_resource(text) for text in args.rate_limit_resource)
        for flag in ("--http-header-forward-pattern", "--grpc-header-forward-pattern"):
            header_forwarding.compile_pattern(_given(args, flag), flag)
    except GeserveError as error:
        parser.error(error.message)
    warnings, refusal = triton_flags.check(args)
    warnings = [*trace_warnings, *warnings]
    if refusal is not None:
        parser.error(refusal)
    if "*" in args.load_model and len(args.load_model) > 1:
        parser.error("--load-model=* must be the only --load-model")
    if args.load_model and args.model_control_mode != "explicit":
        parser.error("--load-model needs --model-control-mode=explicit")
    for location in args.model_repositories:
        repository_refusal = remote.refusal(location)
        if repository_refusal is not None:
            parser.error(repository_refusal)
    logging_settings = LoggingSettings(
        log_file=args.log_file,
        log_info=args.log_info,
        log_warning=args.log_warning,
        log_error=args.log_error,
        log_verbose_level=max(args.log_verbose, 0),
        log_format=args.log_format,
    )
    server = ServerSettings(
        server_id=args.server_id,
        strict_readiness=args.strict_readiness,
        exit_on_error=args.exit_on_error,
        exit_timeout_secs=args.exit_timeout_secs,
        drain_delay_secs=args.drain_delay_secs,
        max_bytes_elements=args.max_bytes_tensor_elements,
        frontend_processes=args.frontend_processes or auto_frontend_processes(),
        protocol_healthcheck_secs=args.protocol_healthcheck_secs,
        warnings=(*cache_warnings, *warnings),
        allow_client_shm=args.allow_client_shm,
        max_client_shm_regions=args.max_client_shm_regions,
        max_client_shm_bytes=args.max_client_shm_bytes,
        response_cache_bytes=cache_bytes,
        logging=logging_settings,
        trace=trace_settings,
    )
    http = HttpSettings(
        enabled=args.allow_http,
        address=args.http_address,
        port=args.http_port,
        reuse_port=args.reuse_http_port,
        max_input_size=args.http_max_input_size,
        max_json_size=args.http_max_json_size,
        header_timeout_s=args.http_header_timeout_secs,
        body_timeout_s=args.http_body_timeout_secs,
        keep_alive_s=args.http_keepalive_timeout_secs,
        max_connections=args.http_max_connections or 0,
        max_header_bytes=args.http_max_header_size,
        send_timeout_s=args.http_send_timeout_secs,
        max_unsent_bytes=args.http_max_unsent_bytes,
        restrictions=http_restrictions,
        openapi=args.http_openapi,
        header_forward_pattern=args.http_header_forward_pattern,
    )
    grpc = GrpcSettings(
        enabled=args.allow_grpc,
        address=args.grpc_address,
        port=args.grpc_port,
        keepalive_time_ms=args.grpc_keepalive_time,
        keepalive_timeout_ms=args.grpc_keepalive_timeout,
        keepalive_permit_without_calls=args.grpc_keepalive_permit_without_calls,
        http2_max_pings_without_data=args.grpc_http2_max_pings_without_data,
        http2_min_recv_ping_interval_without_data_ms=args.grpc_http2_min_recv_ping_interval_without_data,
        http2_max_ping_strikes=args.grpc_http2_max_ping_strikes,
        reuse_port=args.reuse_grpc_port,
        max_connection_age_ms=args.grpc_max_connection_age,
        max_connection_age_grace_ms=args.grpc_max_connection_age_grace,
        max_message_bytes=args.grpc_max_message_size,
        max_concurrent_streams=args.grpc_max_concurrent_streams,
        max_inflight_rpcs=args.grpc_max_inflight_rpcs,
        max_connections=args.grpc_max_connections or 0,
        restrictions=grpc_restrictions,
        tls=grpc_tls,
        header_forward_pattern=args.grpc_header_forward_pattern,
    )
    metrics = MetricsSettings(
        enabled=args.allow_metrics,
        address=args.metrics_address or args.http_address,
        port=args.metrics_port,
        interval_ms=args.metrics_interval_ms,
        cpu_metrics=args.allow_cpu_metrics,
        gpu_metrics=args.allow_gpu_metrics,
        **latency,
    )
    repository = RepositorySettings(
        paths=tuple(Path(location) for location in args.model_repositories if not remote.is_remote(location)),
        remotes=tuple(location for location in args.model_repositories if remote.is_remote(location)),
        control_mode=ControlMode(args.model_control_mode),
        startup_models=tuple(args.load_model),
        poll_secs=float(args.repository_poll_secs),
        config_name=args.model_config_name or "",
    )
    workers = WorkerSettings(
        auto_complete=not args.disable_auto_complete_config and not args.strict_model_config,
        log_level=logging_settings.level,
        log_format=logging_settings.log_format,
        log_file=logging_settings.log_file,
        arena_bytes=args.worker_arena_size,
        pipeline_depth=args.worker_pipeline_depth,
        device_ids=args.device_ids if args.device_ids is not None else discover_devices(),
        stop_timeout_s=float(args.exit_timeout_secs),
        npu_mode=args.npu,
        model_cache_dir=args.model_cache_dir,
        compile_concurrency=args.model_compile_concurrency,
        rate_limit=args.rate_limit,
        rate_limit_resources=rate_limit_resources,
        atc_python=args.atc_python,
    )
    return Settings(server, http, grpc, metrics, repository, workers)


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    # Started as `tritonserver` (the console script of that name), help and errors say so.
    prog = "tritonserver" if argv is None and Path(sys.argv[0]).name == "tritonserver" else "geserve"
    if arguments and arguments[0] == "tritonserver":
        # Triton's runtimes start the image as `tritonserver --model-repository=...`.
        arguments = arguments[1:]
        prog = "tritonserver"
    if arguments and arguments[0] in COMMANDS:
        # Offline tools: no server (and but for `compile`'s chip name, no NPU or pyACL).
        if arguments[0] == "compile":
            from geserve.offline import compile as compile_tool

            return compile_tool.main(arguments[1:], prog)
        if arguments[0] == "inspect":
            from geserve.offline import inspect

            return inspect.main(arguments[1:], prog)
        from geserve.offline import check

        return check.main(arguments[1:], prog)
    settings = parse_settings(arguments, prog)
    logging_settings = settings.server.logging
    # Inherited by the processes a supervisor forks; the worker processes, spawned, set up the same from their spec.
    log_records.log_to(logging_settings.log_file, logging_settings.level, logging_settings.log_format)
    LogControl(logging_settings).apply()
    keep_freed_memory()
    bound_arenas()
    if settings.server.frontend_processes > 1:
        from geserve.multiprocess.supervisor import Supervisor

        return Supervisor(settings).serve()
    from geserve.server import Server  # here: the supervisor of several processes never loads the server

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(Server(settings).serve())


if __name__ == "__main__":
    sys.exit(main())
