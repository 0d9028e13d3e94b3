"""Placement: which backend a config selects, which file it loads, and one InstanceSpec per instance and device."""

from __future__ import annotations

from pathlib import Path

from geserve._generated import model_config_pb2 as mc
from geserve.backends import registry
from geserve.codecs.digits import is_decimal
from geserve.errors import ModelLoadError
from geserve.repository import config as config_io
from geserve.repository.scan import ModelSource
from geserve.settings import WorkerSettings
from geserve.workers import execution_env
from geserve.workers.devices import VISIBLE_DEVICES, worker_visible_devices
from geserve.workers.messages import InstanceSpec

# How Triton names an instance group's kind to python models (args['model_instance_kind']). KIND_MODEL
# instances get device id 0, as Triton gives them, and no device of their own: the model places itself.
_KIND_NAMES = {
    mc.ModelInstanceGroup.KIND_CPU: "CPU",
    mc.ModelInstanceGroup.KIND_GPU: "GPU",
    mc.ModelInstanceGroup.KIND_MODEL: "MODEL",
}


# Backends whose every instance runs on an NPU, whatever its group's kind.
_NPU_ONLY_BACKENDS = ("ge",)


def default_kind(settings: WorkerSettings) -> int:
    """KIND_AUTO resolves to the accelerators when there are any."""
    return mc.ModelInstanceGroup.KIND_GPU if settings.device_ids else mc.ModelInstanceGroup.KIND_CPU


def select_backend(config: mc.ModelConfig, source: ModelSource, versions: list[int]) -> registry.BackendSpec:
    """The backend the config names, else its platform, else the model file present."""
    version_dirs = [source.path / str(version) for version in versions]
    return registry.resolve(config.backend, config.platform, version_dirs, config.default_model_filename)


def fill_defaults(config: mc.ModelConfig, backend: registry.BackendSpec, settings: WorkerSettings) -> None:
    """What Triton fills before it reports a config: the backend, its default file, instance kinds."""
    config_io.fill_defaults(config, backend.name, backend.default_filename, default_kind(settings))


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


# Each instance is a process: the groups of one model version together may ask for no more (each group alone
# is held to the same number by repository.config.MAX_INSTANCES_PER_GROUP).
MAX_INSTANCES_PER_MODEL = 64


def instance_specs(
    source: ModelSource, config: mc.ModelConfig, backend: registry.BackendSpec, version: int, settings: WorkerSettings
) -> list[InstanceSpec]:
    """One spec per instance: `count` per group, times each listed device for KIND_GPU groups."""
    model_path = model_file_path(source, config, backend, version)
    environment = _execution_environment(source, config, backend, settings)
    specs = []
    for position, group in enumerate(config.instance_group):
        _check_kind(config.name, backend, group, position, settings)
        placements: list[tuple[int, tuple[tuple[str, str], ...]]] = [(0, ())]
        if group.kind == mc.ModelInstanceGroup.KIND_GPU:
            placements = [
                (device, _device_environment(device)) for device in _group_devices(config.name, group, settings)
            ]
        for device, device_environment in placements:
            for index in range(group.count):
                # Triton's `<group>_<k>` (core backend_model.cc); where a group spans several devices Triton gives
                # each device's instance the same name, which here each worker's own name tells apart.
                suffix = f"_{index}" + (f"_device{device}" if len(placements) > 1 else "")
                specs.append(
                    InstanceSpec(
                        model_name=config.name,
                        model_version=version,
                        instance_name=f"{group.name}{suffix}",
                        backend=backend.name,
                        config=config.SerializeToString(),
                        model_path=str(model_path),
                        model_directory=str(source.path),
                        device_id=device,
                        auto_complete=settings.auto_complete,
                        log_level=settings.log_level,
                        log_format=settings.log_format,
                        log_file=settings.log_file,
                        environment=device_environment + (environment.variables if environment else ()),
                        on_device=group.kind == mc.ModelInstanceGroup.KIND_GPU,
                        kind=_KIND_NAMES.get(group.kind, "CPU"),
                        passive=group.passive,
                        group=position,
                        polled=group.kind == mc.ModelInstanceGroup.KIND_GPU or backend.per_request,
                        interpreter=environment.interpreter if environment else "",
                        search_path=environment.search_path if environment else (),
                    )
                )
    if len(specs) > MAX_INSTANCES_PER_MODEL:
        raise ModelLoadError(
            f"model '{config.name}' version {version} asks for {len(specs)} instances in all (every instance "
            f"group, times its devices); the limit is {MAX_INSTANCES_PER_MODEL} instances per model"
        )
    return specs


def _execution_environment(
    source: ModelSource, config: mc.ModelConfig, backend: registry.BackendSpec, settings: WorkerSettings
) -> execution_env.ExecutionEnvironment | None:
    """A python model's EXECUTION_ENV_PATH, unpacked and checked (other backends do not read it, as Triton's)."""
    if backend.name != "python" or execution_env.requested_path(config, source.path) is None:
        return None
    if not settings.process_workers:
        raise ModelLoadError(
            f"model '{config.name}': {execution_env.PARAMETER} runs the model's instances with the environment's "
            "interpreter, in processes of their own; this server runs backends on its own threads"
        )
    return execution_env.prepare(config, source.path)


def _check_kind(
    model: str, backend: registry.BackendSpec, group: mc.ModelInstanceGroup, position: int, settings: WorkerSettings
) -> None:
    """The ge backend opens an NPU whatever the group says: a KIND_CPU group would land on NPU 0 unasked.
    (A ge model that is served by ONNX Runtime on a host without NPUs was given another backend before this.)"""
    if backend.name not in _NPU_ONLY_BACKENDS or group.kind != mc.ModelInstanceGroup.KIND_CPU:
        return
    hint = (
        "; this server has no NPUs (none found, and no --device-ids), so KIND_AUTO means KIND_CPU here: "
        "put the model's model.onnx beside the .om to serve it with ONNX Runtime on such a host, or make the "
        "NPUs visible (install CANN, source its set_env.sh, and check the /dev/davinciN devices)"
        if not settings.device_ids
        # A Triton config migrated to `ge` often keeps the CPU group it had with onnxruntime.
        else "; a config migrated from Triton: change kind to KIND_GPU or KIND_AUTO, or drop instance_group (one "
        'instance per NPU); to serve it on the CPU instead, set backend: "onnxruntime" (it runs model.onnx)'
    )
    named = f" ('{group.name}')" if group.name else ""
    raise ModelLoadError(
        f"model '{model}': instance_group[{position}]{named} has kind KIND_CPU, but the "
        f"'{backend.name}' backend runs .om models on Ascend NPUs only: use KIND_GPU (the NPUs, chosen by "
        f"'gpus') or KIND_AUTO{hint}"
    )


def _group_devices(model: str, group: mc.ModelInstanceGroup, settings: WorkerSettings) -> list[int]:
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
