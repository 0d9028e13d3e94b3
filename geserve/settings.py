"""Typed settings, one section per layer (server, http, grpc, metrics, repository, workers); built once by the CLI."""

from __future__ import annotations

import logging
from dataclasses import dataclass

# Shared memory per worker process for a batch's inputs, and as much for its outputs.
DEFAULT_ARENA_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """How model instances are placed and run."""

    process_workers: bool = True  # False runs backends on threads of this process (tests, debugging)
    auto_complete: bool = True  # complete configs from the model files
    log_level: int = logging.INFO
    arena_bytes: int = DEFAULT_ARENA_BYTES  # per worker, each way
    pipeline_depth: int = 1  # batches a worker holds at once
    device_ids: tuple[int, ...] = ()  # accelerators (NPUs) instances may use
    stop_timeout_s: float = 30.0
