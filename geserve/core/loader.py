"""Loading a model folder: config, backend resolution, versions, and one worker per instance."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace

from geserve._generated import model_config_pb2 as mc
from geserve.backends import registry
from geserve.batching.batcher import Scheduler
from geserve.batching.policy import BatchingPolicy
from geserve.core.models import Model, ModelVersion
from geserve.core.stats import ModelStats
from geserve.errors import ModelLoadError
from geserve.repository import config as config_io
from geserve.repository.scan import ModelSource, available_versions, select_versions
from geserve.workers.client import InProcessWorker, ProcessWorker, WorkerClient
from geserve.workers.messages import InstanceSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadSettings:
    """Server-wide choices that affect how models load."""

    auto_complete: bool = True
    process_workers: bool = True  # False runs backends in this process (tests, debugging)
    log_level: int = logging.INFO
    stop_timeout_s: float = 30.0


async def load_model(source: ModelSource, settings: LoadSettings) -> Model:
    """Load every version the policy selects; a failure is recorded as the model's reason."""
    model = Model(source.name)
    try:
        config, spec, versions = await asyncio.to_thread(_prepare, source)
        loaded = await asyncio.gather(
            *(_load_version(source, config, spec, version, settings) for version in versions),
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


def _prepare(source: ModelSource) -> tuple[mc.ModelConfig, registry.BackendSpec, list[int]]:
    config, _ = config_io.read_model_config(source.path, source.name)
    versions = select_versions(available_versions(source.path), config.version_policy)
    if not versions:
        raise ModelLoadError(
            f"at least one version must be available under the version policy of model '{source.name}'"
        )
    version_dirs = [source.path / str(version) for version in versions]
    spec = registry.resolve(config.backend, config.platform, version_dirs, config.default_model_filename)
    config_io.fill_defaults(config, spec.name, spec.default_filename, mc.ModelInstanceGroup.KIND_CPU)
    return config, spec, versions


def _instance_specs(
    source: ModelSource, config: mc.ModelConfig, backend: str, version: int, settings: LoadSettings
) -> list[InstanceSpec]:
    version_dir = source.path / str(version)
    model_path = version_dir / config.default_model_filename if config.default_model_filename else version_dir
    specs = []
    for group in config.instance_group:
        # KIND_GPU groups name accelerator ids (NPUs on Ascend); others run on device 0.
        devices = list(group.gpus) if group.kind == mc.ModelInstanceGroup.KIND_GPU and group.gpus else [0]
        for device in devices:
            for index in range(group.count):
                suffix = f"_{index}" + (f"_device{device}" if len(devices) > 1 else "")
                specs.append(
                    InstanceSpec(
                        model_name=config.name,
                        model_version=version,
                        instance_name=f"{group.name}{suffix}",
                        backend=backend,
                        config=config.SerializeToString(),
                        model_path=str(model_path),
                        device_id=device,
                        auto_complete=settings.auto_complete,
                        log_level=settings.log_level,
                    )
                )
    return specs


def _worker(spec: InstanceSpec, settings: LoadSettings) -> WorkerClient:
    return ProcessWorker(spec) if settings.process_workers else InProcessWorker(spec)


async def _load_version(
    source: ModelSource,
    config: mc.ModelConfig,
    spec: registry.BackendSpec,
    version: int,
    settings: LoadSettings,
) -> ModelVersion:
    started_ns = time.monotonic_ns()
    specs = _instance_specs(source, config, spec.name, version, settings)
    # The first instance completes the config from the model file; the others load that config as is.
    first = _worker(specs[0], settings)
    completed = await first.start()
    started: list[WorkerClient] = [first]
    try:
        config_io.fill_defaults(completed, spec.name, spec.default_filename, mc.ModelInstanceGroup.KIND_CPU)
        config_io.validate_config(completed)
        payload = completed.SerializeToString()
        others = [_worker(replace(item, config=payload, auto_complete=False), settings) for item in specs[1:]]
        results = await asyncio.gather(*(worker.start() for worker in others), return_exceptions=True)
        started += [w for w, r in zip(others, results, strict=True) if not isinstance(r, BaseException)]
        for result in results:
            if isinstance(result, BaseException):
                raise result
    except BaseException:
        await asyncio.gather(*(worker.stop(settings.stop_timeout_s) for worker in started))
        raise
    logger.info("loaded model '%s' version %d with %d instance(s)", completed.name, version, len(started))
    stats = ModelStats()
    stats.load_duration_s = (time.monotonic_ns() - started_ns) / 1e9
    scheduler = Scheduler(completed.name, started, BatchingPolicy.from_config(completed), stats)
    return ModelVersion(completed, version, scheduler, stats)
