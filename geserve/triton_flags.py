"""tritonserver flags geserve does not honour: ignored with a warning where only tuning, refused otherwise."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

# Flags that only tune machinery geserve does not have (CUDA and pinned memory pools, shared-library
# folders, thread pools): accepted so that a tritonserver command line starts geserve unchanged.
IGNORED = {
    "--backend-directory": "geserve's backends are built in",
    "--repoagent-directory": "geserve's repository agents are built in (checksum)",
    "--cache-directory": "geserve has no cache libraries",
    "--pinned-memory-pool-byte-size": "geserve has no pinned memory pool; batches travel in each worker's "
    "shared-memory arenas (--worker-arena-size)",
    "--cuda-memory-pool-byte-size": "geserve has no CUDA memory pool",
    "--cuda-virtual-address-size": "geserve has no CUDA memory pool",
    "--min-supported-compute-capability": "geserve does not run on CUDA devices",
    "--buffer-manager-thread-count": "tensor copies run on the worker processes",
    "--host-policy": "geserve places instances by --device-ids",
    "--model-load-gpu-limit": "geserve does not run on CUDA devices",
    "--http-thread-count": "HTTP is served by one event loop",
    "--grpc-infer-thread-count": "gRPC is served by one event loop",
    "--grpc-max-response-pool-size": "gRPC responses are not pooled",
    "--enable-peer-access": "geserve does not run on CUDA devices",
    "--grpc-infer-allocation-pool-size": "gRPC messages are not pooled",
    "--grpc-infer-response-compression-level": "responses are sent uncompressed",
    "--model-load-thread-count": "models load concurrently on the event loop",
    "--model-load-retry-count": "a failed load is reported at once",
    "--sagemaker-port": "ignored without --allow-sagemaker",
    "--sagemaker-safe-port-range": "ignored without --allow-sagemaker",
    "--sagemaker-thread-count": "ignored without --allow-sagemaker",
    "--vertex-ai-port": "ignored without --allow-vertex-ai",
    "--vertex-ai-thread-count": "ignored without --allow-vertex-ai",
    "--vertex-ai-default-model": "ignored without --allow-vertex-ai",
}

_FALSE = {"false", "0", "off"}


@dataclass(frozen=True, slots=True)
class Refusal:
    """A flag geserve refuses when its value would change behaviour; `accepts` says which values are harmless."""

    why: str
    accepts: Callable[[str], bool] = lambda value: False


REFUSED = {
    "--model-namespacing": Refusal("model names are global in geserve", lambda v: v.lower() in _FALSE),
    "--allow-sagemaker": Refusal("geserve has no SageMaker endpoint", lambda v: v.lower() in _FALSE),
    "--allow-vertex-ai": Refusal("geserve has no Vertex AI endpoint", lambda v: v.lower() in _FALSE),
}

# --backend-config=<backend>,<key>=<value>: tuning keys are ignored; these change what models become.
# What auto-complete gives a model that leaves max_batch_size out, whatever the backend configuration says.
AUTO_COMPLETE_BATCH = (
    "geserve's auto-complete cannot take another default: it gives a batchable ONNX model max_batch_size 4 "
    "(Triton's default), an .om model the batch its file was built for, and a python model what its "
    "auto_complete_config sets; write max_batch_size in config.pbtxt instead"
)
REFUSED_BACKEND_KEYS = {"default-max-batch-size": Refusal(AUTO_COMPLETE_BATCH, lambda value: value.strip() == "4")}

# Every flag of tritonserver's command line (src/command_line_parser.cc), deprecated ones included: those
# geserve has no flag for (see `unrecognized`) are named as Triton's rather than as unknown.
TRITONSERVER_FLAGS = (
    *("--help", "--id", "--exit-timeout-secs"),
    *("--log-verbose", "--log-info", "--log-warning", "--log-error", "--log-format", "--log-file"),
    *("--model-store", "--model-repository", "--exit-on-error", "--disable-auto-complete-config"),
    *("--strict-readiness", "--model-control-mode", "--repository-poll-secs", "--load-model"),
    *("--model-config-name", "--model-load-thread-count", "--model-load-retry-count", "--model-namespacing"),
    "--enable-peer-access",
    *("--allow-http", "--http-address", "--http-port", "--reuse-http-port", "--http-header-forward-pattern"),
    *("--http-thread-count", "--http-restricted-api"),
    *("--allow-grpc", "--grpc-address", "--grpc-port", "--reuse-grpc-port", "--grpc-header-forward-pattern"),
    *("--grpc-infer-thread-count", "--grpc-infer-allocation-pool-size", "--grpc-max-response-pool-size"),
    *("--grpc-use-ssl", "--grpc-use-ssl-mutual", "--grpc-server-cert", "--grpc-server-key", "--grpc-root-cert"),
    *("--grpc-infer-response-compression-level", "--grpc-keepalive-time", "--grpc-keepalive-timeout"),
    *("--grpc-keepalive-permit-without-calls", "--grpc-http2-max-pings-without-data"),
    *("--grpc-http2-min-recv-ping-interval-without-data", "--grpc-http2-max-ping-strikes"),
    *("--grpc-max-connection-age", "--grpc-max-connection-age-grace", "--grpc-restricted-protocol"),
    *("--allow-sagemaker", "--sagemaker-port", "--sagemaker-safe-port-range", "--sagemaker-thread-count"),
    *("--allow-vertex-ai", "--vertex-ai-port", "--vertex-ai-thread-count", "--vertex-ai-default-model"),
    *("--allow-metrics", "--allow-gpu-metrics", "--allow-cpu-metrics", "--metrics-address", "--metrics-port"),
    *("--metrics-interval-ms", "--metrics-config"),
    *("--trace-config", "--trace-file", "--trace-level", "--trace-rate", "--trace-count", "--trace-log-frequency"),
    *("--cache-config", "--cache-directory", "--response-cache-byte-size"),
    *("--rate-limit", "--rate-limit-resource"),
    *("--pinned-memory-pool-byte-size", "--cuda-memory-pool-byte-size", "--cuda-virtual-address-size"),
    *("--min-supported-compute-capability", "--buffer-manager-thread-count", "--host-policy"),
    *("--model-load-gpu-limit", "--backend-directory", "--backend-config", "--repoagent-directory"),
    "--strict-model-config",
)


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The tritonserver flags above, hidden from --help (docs/compatibility.md lists them)."""
    for flag in (*IGNORED, *REFUSED, "--backend-config"):
        parser.add_argument(flag, action="append", nargs="?", const="true", help=argparse.SUPPRESS)


def check(args: argparse.Namespace) -> tuple[list[str], str | None]:
    """(warnings for ignored flags, the first refusal's message or None)."""
    warnings = []
    for flag, why in IGNORED.items():
        if getattr(args, _dest(flag)):
            warnings.append(f"ignoring {flag}: {why}")
    for flag, refusal in REFUSED.items():
        for value in getattr(args, _dest(flag)) or []:
            if not refusal.accepts(value):
                return warnings, f"{flag}={value} is not supported: {refusal.why}"
    for setting in args.backend_config or []:
        backend, _, pair = setting.partition(",")
        key, _, value = (pair or backend).partition("=")
        refused = REFUSED_BACKEND_KEYS.get(key)
        if refused is not None and not refused.accepts(value):
            return warnings, f"--backend-config={setting} is not supported: {refused.why}"
        if refused is not None:
            warnings.append(f"ignoring --backend-config={setting}: auto-complete gives ONNX models 4 already")
            continue
        warnings.append(f"ignoring --backend-config={setting}: only tuning of Triton's own backends")
    return warnings, None


def unrecognized(extras: list[str]) -> str:
    """argparse's error for arguments no flag took, saying whose flag each one is (a tritonserver flag geserve
    does not handle, or neither geserve's nor tritonserver's)."""
    flags = [extra.partition("=")[0] for extra in extras if extra.startswith("-")]
    triton = [flag for flag in flags if flag in TRITONSERVER_FLAGS]
    unknown = [flag for flag in flags if flag not in TRITONSERVER_FLAGS]
    reasons = [f"{flag} is a tritonserver flag geserve does not handle" for flag in triton]
    reasons += [f"{flag} is not a geserve or tritonserver flag" for flag in unknown]
    if len(flags) < len(extras):
        reasons.append(f"unrecognized arguments: {' '.join(extra for extra in extras if not extra.startswith('-'))}")
    return "; ".join(reasons)


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")
