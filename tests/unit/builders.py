"""Builders for core objects that unit tests need without workers."""

from __future__ import annotations

from geserve._generated import model_config_pb2 as mc
from geserve.batching.lifecycle import InstanceLifecycle
from geserve.batching.policy import BatchingPolicy
from geserve.batching.scheduler import Scheduler
from geserve.core.models import ModelVersion
from geserve.core.stats import ModelStats
from geserve.workers.pool import InstancePool


def model_version(config: mc.ModelConfig, version: int = 1) -> ModelVersion:
    """A ModelVersion with no instances: enough for validation and codecs."""
    stats = ModelStats()
    pool = InstancePool([])
    scheduler = Scheduler(config.name, pool, BatchingPolicy.from_config(config), stats)
    return ModelVersion(config, version, scheduler, InstanceLifecycle(config.name, pool, scheduler), stats)
