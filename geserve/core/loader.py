"""Loading a model folder: its config, the versions its policy serves, and a scheduler per version."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

from geserve._generated import model_config_pb2 as mc
from geserve.batching.lifecycle import InstanceLifecycle
from geserve.batching.policy import BatchingPolicy
from geserve.batching.scheduler import Scheduler
from geserve.batching.sequence import SequenceScheduler
from geserve.batching.warmup import warm_up
from geserve.core import ensemble, response_cache, warmup
from geserve.core.classification import read_labels
from geserve.core.models import Model, ModelVersion
from geserve.core.pool_factory import PoolFactory
from geserve.core.stats import ModelStats
from geserve.errors import ModelLoadError
from geserve.repository import agents, sequence
from geserve.repository import config as config_io
from geserve.repository.scan import ModelSource, available_versions, select_versions

logger = logging.getLogger(__name__)

# A version that fails after its instances started has admitted no request: its idle instances stop at once.
_STOP_UNSERVED_S = 10.0


async def load_model(
    source: ModelSource,
    pools: PoolFactory,
    override: mc.ModelConfig | None = None,
    models: Mapping[str, Model] | None = None,
) -> Model:
    """Load every version the policy selects; a failure is recorded as the model's reason. `override`
    replaces config.pbtxt (the repository API's `config` parameter); auto-complete fills what it omits.
    An ensemble's steps run on the loaded `models`."""
    model = Model(source.name)
    try:
        config, versions = await asyncio.to_thread(prepare_model, source, pools, override)
        loaded = await asyncio.gather(
            *(_load_version(source, config, version, pools, models or {}) for version in versions),
            return_exceptions=True,
        )
    except ModelLoadError as error:
        model.reason = error.message
        return model
    failures = []
    for version, result in zip(versions, loaded, strict=True):
        if isinstance(result, ModelVersion):
            model.versions[version] = result
        elif isinstance(result, ModelLoadError):
            failures.append(f"version {version}: {result.message}")
        elif isinstance(result, BaseException):
            logger.error("model '%s' version %d failed to load", source.name, version, exc_info=result)
            failures.append(f"version {version}: {type(result).__name__}: {result}")
    if failures:
        model.reason = "; ".join(failures)
    return model


def prepare_model(
    source: ModelSource, pools: PoolFactory, override: mc.ModelConfig | None = None
) -> tuple[mc.ModelConfig, list[int]]:
    """The model's config (or `override`) with its backend's defaults, and the versions its policy serves;
    no model file is opened."""
    if override is not None:
        config = mc.ModelConfig()
        config.CopyFrom(override)
    else:
        config, _ = config_io.read_model_config(source.path, source.name, source.config_name)
    config_io.refuse_unsupported(config)
    agents.run_agents(config, source.path)  # Triton's repository agents act before the model loads
    response_cache.check_config(config)
    if ensemble.is_ensemble(config):
        ensemble.validate_scheduling(config)
        warmup.refuse_for_ensemble(config)
        if not config.HasField("version_policy"):
            config.version_policy.latest.num_versions = 1
    versions = select_versions(available_versions(source.path), config.version_policy)
    if not versions:
        raise ModelLoadError(
            f"at least one version must be available under the version policy of model '{source.name}'"
        )
    if ensemble.is_ensemble(config):
        config_io.validate_config(config)
        return config, versions
    pools.complete(config, source, versions)
    sequence.read_states(config, source.path)  # a bad initial_state fails the load before any worker starts
    return config, versions


async def _load_version(
    source: ModelSource, config: mc.ModelConfig, version: int, pools: PoolFactory, models: Mapping[str, Model]
) -> ModelVersion:
    started_ns = time.monotonic_ns()
    if ensemble.is_ensemble(config):
        ensemble.check_steps(config, ensemble.LoadedModels(models))
        stats = ModelStats()
        stats.load_duration_s = (time.monotonic_ns() - started_ns) / 1e9
        steps_scheduler = ensemble.EnsembleScheduler(config, models, stats)
        return ModelVersion(config, version, steps_scheduler, steps_scheduler.instances, stats)
    pool, completed = await pools.create(source, config, version)
    stats = ModelStats()
    stats.load_duration_s = (time.monotonic_ns() - started_ns) / 1e9
    scheduler: Scheduler | SequenceScheduler
    if completed.HasField("sequence_batching"):
        scheduler = SequenceScheduler(completed.name, pool, sequence.settings_of(completed), stats)
    else:
        scheduler = Scheduler(completed.name, pool, BatchingPolicy.from_config(completed), stats)
    instances = InstanceLifecycle(completed.name, pool, scheduler)
    served = ModelVersion(completed, version, scheduler, instances, stats)
    served.instance_count = pool.size
    try:
        served.labels = await asyncio.to_thread(read_labels, source.path, completed)
        # Not ready until every instance has run its warmup samples: the version is served only once returned.
        samples = await asyncio.to_thread(warmup.build_samples, served, source.path)
        await warm_up(completed.name, pool, samples)
    except asyncio.CancelledError:
        pool.kill()  # a load given up (an unload, a shutdown): a warmup that never returns is not waited for
        raise
    except BaseException:
        await pool.stop(_STOP_UNSERVED_S)
        raise
    stats.load_duration_s = (time.monotonic_ns() - started_ns) / 1e9
    return served
