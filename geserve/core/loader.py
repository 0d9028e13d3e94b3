"""Loading a model folder: config, backend resolution, versions, and one worker per instance."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

from geserve._generated import model_config_pb2 as mc
from geserve.backends import registry
from geserve.batching.batcher import Scheduler
from geserve.batching.policy import BatchingPolicy
from geserve.codecs.digits import is_decimal
from geserve.core.classification import read_labels
from geserve.core.models import Model, ModelVersion
from geserve.core.stats import ModelStats
from geserve.errors import ModelLoadError
from geserve.repository import config as config_io
from geserve.repository.scan import ModelSource, available_versions, select_versions
from geserve.workers.client import InProcessWorker, WorkerClient
from geserve.workers.devices import VISIBLE_DEVICES, worker_visible_devices
from geserve.workers.messages import InstanceSpec
from geserve.workers.process import ProcessWorker
from geserve.workers.shm import DEFAULT_ARENA_BYTES

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadSettings:
    """Server-wide choices that affect how models load."""

    auto_complete: bool = True
    process_workers: bool = True  # False runs backends in this process (tests, debugging)
    log_level: int = logging.INFO
    stop_timeout_s: float = 30.0
    arena_bytes: int = DEFAULT_ARENA_BYTES  # per worker, each way
    pipeline_depth: int = 1  # batches a worker holds at once
    device_ids: tuple[int, ...] = ()  # accelerators (NPUs) instances may use

    @property
    def default_kind(self) -> int:
        """KIND_AUTO resolves to the accelerators when there are any."""
        return mc.ModelInstanceGroup.KIND_GPU if self.device_ids else mc.ModelInstanceGroup.KIND_CPU


async def load_model(source: ModelSource, settings: LoadSettings, override: mc.ModelConfig | None = None) -> Model:
    """Load every version the policy selects; a failure is recorded as the model's reason. `override`
    replaces config.pbtxt (the repository API's `config` parameter); auto-complete fills what it omits."""
    model = Model(source.name)
    try:
        config, spec, versions = await asyncio.to_thread(prepare_model, source, override)
        config_io.fill_defaults(config, spec.name, spec.default_filename, settings.default_kind)
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


def prepare_model(
    source: ModelSource, override: mc.ModelConfig | None = None
) -> tuple[mc.ModelConfig, registry.BackendSpec, list[int]]:
    """The model's config (or `override`), its backend and the versions its policy serves; no file is opened."""
    if override is not None:
        config = mc.ModelConfig()
        config.CopyFrom(override)
    else:
        config, _ = config_io.read_model_config(source.path, source.name)
    config_io.refuse_unsupported(config)
    versions = select_versions(available_versions(source.path), config.version_policy)
    if not versions:
        raise ModelLoadError(
            f"at least one version must be available under the version policy of model '{source.name}'"
        )
    version_dirs = [source.path / str(version) for version in versions]
    spec = registry.resolve(config.backend, config.platform, version_dirs, config.default_model_filename)
    return config, spec, versions


def model_file_path(source: ModelSource, config: mc.ModelConfig, backend: registry.BackendSpec, version: int) -> Path:
    """The version's model file, or the file the backend's path parameter names."""
    parameter = config.parameters.get(backend.path_parameter) if backend.path_parameter else None
    if parameter is not None and parameter.string_value:
        return _named_model_file(source, config.name, backend, parameter.string_value)
    version_dir = source.path / str(version)
    return version_dir / config.default_model_filename if config.default_model_filename else version_dir


def _named_model_file(source: ModelSource, model: str, backend: registry.BackendSpec, value: str) -> Path:
    """A path parameter resolved inside the model's folder, then inside the repository (configs written
    for Triton's GE backend name the file relative to the repository); never outside the repository."""
    repository = source.path.parent.resolve()
    looked = []
    for base in (source.path.resolve(), repository):
        path = (base / value).resolve()
        if not path.is_relative_to(repository):
            raise ModelLoadError(
                f"model '{model}': parameter '{backend.path_parameter}' ('{value}') must name a file inside the "
                "model repository"
            )
        if path.is_file():
            return path
        looked.append(str(path))
    found = sorted(
        str(path.relative_to(source.path))
        for path in source.path.glob(f"*/*{Path(backend.default_filename).suffix}")
        if is_decimal(path.parent.name)
    )
    raise ModelLoadError(
        f"model '{model}': parameter '{backend.path_parameter}' ('{value}') names no file: looked at "
        f"{' and '.join(repr(p) for p in looked)}; {backend.default_filename.split('.')[-1]} files in the version "
        f"folders: {found or 'none'}"
    )


def _instance_specs(
    source: ModelSource, config: mc.ModelConfig, backend: registry.BackendSpec, version: int, settings: LoadSettings
) -> list[InstanceSpec]:
    """One spec per instance: `count` per group, times each listed device for KIND_GPU groups."""
    model_path = model_file_path(source, config, backend, version)
    specs = []
    for group in config.instance_group:
        placements: list[tuple[int, tuple[tuple[str, str], ...]]] = [(0, ())]
        if group.kind == mc.ModelInstanceGroup.KIND_GPU:
            placements = [
                (device, _device_environment(device)) for device in _group_devices(config.name, group, settings)
            ]
        for device, environment in placements:
            for index in range(group.count):
                suffix = f"_{index}" + (f"_device{device}" if environment else "")
                specs.append(
                    InstanceSpec(
                        model_name=config.name,
                        model_version=version,
                        instance_name=f"{group.name}{suffix}",
                        backend=backend.name,
                        config=config.SerializeToString(),
                        model_path=str(model_path),
                        device_id=device,
                        auto_complete=settings.auto_complete,
                        log_level=settings.log_level,
                        environment=environment,
                        on_device=group.kind == mc.ModelInstanceGroup.KIND_GPU,
                        polled=group.kind == mc.ModelInstanceGroup.KIND_GPU or backend.per_request,
                    )
                )
    return specs


def _group_devices(model: str, group: mc.ModelInstanceGroup, settings: LoadSettings) -> list[int]:
    available = settings.device_ids
    wanted = list(group.gpus) or list(available)
    if not wanted:
        raise ModelLoadError(
            f"instance group '{group.name}' of model '{model}' asks for accelerator devices (KIND_GPU), but none "
            "are available; give --device-ids or use KIND_CPU"
        )
    missing = [device for device in wanted if device not in available]
    if missing:
        raise ModelLoadError(
            f"instance group '{group.name}' of model '{model}' names devices {missing}, which are not available "
            f"(available: {list(available)})"
        )
    return wanted


def _device_environment(device: int) -> tuple[tuple[str, str], ...]:
    # The worker sees only its own NPU, re-indexed as device 0 (pyACL's recommended setup).
    return ((VISIBLE_DEVICES, worker_visible_devices(device)),)


def _worker(spec: InstanceSpec, settings: LoadSettings) -> WorkerClient:
    if settings.process_workers:
        return ProcessWorker(spec, settings.arena_bytes, pipeline_depth=settings.pipeline_depth)
    return InProcessWorker(spec)


async def _load_version(
    source: ModelSource,
    config: mc.ModelConfig,
    spec: registry.BackendSpec,
    version: int,
    settings: LoadSettings,
) -> ModelVersion:
    started_ns = time.monotonic_ns()
    specs = await asyncio.to_thread(_instance_specs, source, config, spec, version, settings)
    # The first instance completes the config from the model file; the others load that config as is.
    first = _worker(specs[0], settings)
    completed = await first.start()
    started: list[WorkerClient] = [first]
    try:
        config_io.fill_defaults(completed, spec.name, spec.default_filename, settings.default_kind)
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
    policy = BatchingPolicy.from_config(completed)
    scheduler = Scheduler(completed.name, started, policy, stats, describe_requests=spec.per_request)
    served = ModelVersion(completed, version, scheduler, stats)
    served.labels = await asyncio.to_thread(read_labels, source.path, completed)
    return served
