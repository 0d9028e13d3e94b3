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
    "--pinned-memory-pool-byte-size": "geserve has no pinned memory pool",
    "--cuda-memory-pool-byte-size": "geserve has no CUDA memory pool",
    "--cuda-virtual-address-size": "geserve has no CUDA memory pool",
    "--min-supported-compute-capability": "geserve does not run on CUDA devices",
    "--buffer-manager-thread-count": "tensor copies run on the worker processes",
    "--host-policy": "geserve places instances by --device-ids",
    "--model-load-gpu-limit": "geserve does not run on CUDA devices",
    "--http-thread-count": "HTTP is served by one event loop",
    "--grpc-infer-allocation-pool-size": "gRPC messages are not pooled",
    "--grpc-infer-response-compression-level": "responses are sent uncompressed",
    "--model-load-thread-count": "models load concurrently on the event loop",
    "--model-load-retry-count": "a failed load is reported at once",
    "--grpc-server-cert": "ignored without --grpc-use-ssl, as in Triton",
    "--grpc-server-key": "ignored without --grpc-use-ssl, as in Triton",
    "--grpc-root-cert": "ignored without --grpc-use-ssl, as in Triton",
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
    "--grpc-use-ssl": Refusal("geserve serves plain gRPC; terminate TLS in front of it", lambda v: v.lower() in _FALSE),
    "--grpc-use-ssl-mutual": Refusal(
        "geserve serves plain gRPC; terminate TLS in front of it", lambda v: v.lower() in _FALSE
    ),
    "--rate-limit": Refusal("geserve has no rate limiter", lambda v: v.lower() == "off"),
    "--rate-limit-resource": Refusal("geserve has no rate limiter"),
    "--model-namespacing": Refusal("model names are global in geserve", lambda v: v.lower() in _FALSE),
    "--http-header-forward-pattern": Refusal("headers are not forwarded as request parameters"),
    "--grpc-header-forward-pattern": Refusal("headers are not forwarded as request parameters"),
    "--model-config-name": Refusal("geserve reads config.pbtxt only"),
    "--allow-sagemaker": Refusal("geserve has no SageMaker endpoint", lambda v: v.lower() in _FALSE),
    "--allow-vertex-ai": Refusal("geserve has no Vertex AI endpoint", lambda v: v.lower() in _FALSE),
}

# --backend-config=<backend>,<key>=<value>: tuning keys are ignored; these change what models become.
REFUSED_BACKEND_KEYS = {
    "default-max-batch-size": "geserve's auto-complete does not invent a max_batch_size",
}


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The tritonserver flags above, hidden from --help (the README's table lists them)."""
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
        key = (pair or backend).partition("=")[0]
        if key in REFUSED_BACKEND_KEYS:
            return warnings, f"--backend-config={setting} is not supported: {REFUSED_BACKEND_KEYS[key]}"
        warnings.append(f"ignoring --backend-config={setting}: only tuning of Triton's own backends")
    return warnings, None


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")
