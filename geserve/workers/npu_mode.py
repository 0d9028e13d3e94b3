"""Which runtime serves a `ge` model version: its `.om`, an `.om` compiled from its model.onnx, or ONNX Runtime."""

from __future__ import annotations

import enum
import functools
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from geserve._generated import model_config_pb2 as mc
from geserve.atc import cache, compiler, host
from geserve.backends import registry
from geserve.errors import ModelLoadError
from geserve.repository.scan import ModelSource
from geserve.settings import WorkerSettings
from geserve.workers.placement import model_file_path

logger = logging.getLogger(__name__)

ONNX_FILE = "model.onnx"
# Shown in the served config (GET /v2/models/<m>/config) when a `ge` model runs on ONNX Runtime: why.
FALLBACK_PARAMETER = "npu_fallback"


class NpuMode(enum.StrEnum):
    AUTO = "auto"  # the NPU where there is one, else ONNX Runtime for models that ship model.onnx
    REQUIRED = "required"  # the NPU or a failed load
    OFF = "off"  # ONNX Runtime for every `ge` model with a model.onnx


@dataclass(frozen=True, slots=True)
class Resolved:
    """The config and backend a version's instances run, and the `.om` they load when it was compiled."""

    config: mc.ModelConfig
    backend: registry.BackendSpec
    model_path: Path | None = None


def has_om(source: ModelSource, config: mc.ModelConfig, backend: registry.BackendSpec, version: int) -> bool:
    """The version has the `.om` the config names (a model_path naming no file counts: the backend says so)."""
    try:
        return model_file_path(source, config, backend, version).is_file()
    except ModelLoadError:
        return True


class NpuResolver:
    """Decides per version; remembers the host's chip, asked of pyACL once."""

    def __init__(self, settings: WorkerSettings) -> None:
        self._settings = settings

    def resolve(
        self,
        source: ModelSource,
        config: mc.ModelConfig,
        backend: registry.BackendSpec,
        version: int,
        cancel: threading.Event | None = None,
    ) -> Resolved:
        """Blocks for as long as ATC compiles (minutes): run it on the compile threads; `cancel` stops ATC."""
        if backend.name != "ge":
            return Resolved(config, backend)
        mode = NpuMode(self._settings.npu_mode)
        onnx = source.path / str(version) / ONNX_FILE
        has_onnx = onnx.is_file()
        where = f"model '{config.name}' version {version}"
        if mode is NpuMode.OFF:
            if not has_onnx:
                raise ModelLoadError(
                    f"{where}: --npu=off serves 'ge' models with ONNX Runtime, but '{onnx}' does not exist"
                )
            return self._fallback(config, version, "--npu=off")
        absent = self._npu_absence()
        if absent is not None:
            if mode is NpuMode.REQUIRED:
                raise ModelLoadError(f"{where}: --npu=required, but {absent}")
            # Without model.onnx there is nothing to fall back to: the .om fails to load as it always has.
            return self._fallback(config, version, absent) if has_onnx else Resolved(config, backend)
        if has_om(source, config, backend, version) or not has_onnx:
            return Resolved(config, backend)
        atc = host.find_atc()
        if atc is None:
            reason = "the version folder holds model.onnx and no .om, and CANN's atc is not on PATH to compile it"
            if mode is NpuMode.REQUIRED:
                raise ModelLoadError(f"{where}: --npu=required, but {reason} (source CANN's set_env.sh)")
            return self._fallback(config, version, reason)
        tools = compiler.Toolchain(atc, self._chip, host.cann_version(atc=atc), self.cache_dir)
        compiled = compiler.compile_version(config, onnx, source.path, tools, cancel)
        return Resolved(config, backend, compiled.om)

    @property
    def cache_dir(self) -> Path:
        return self._settings.model_cache_dir or cache.default_dir()

    def _npu_absence(self) -> str | None:
        if not self._settings.device_ids:
            return "this host has no NPU (none found, or --device-ids is empty)"
        if not host.has_pyacl():
            return "pyACL cannot be imported (install CANN and source its set_env.sh)"
        return None

    @functools.cached_property
    def _chip(self) -> str:
        return host.soc_name()

    @staticmethod
    def _fallback(config: mc.ModelConfig, version: int, reason: str) -> Resolved:
        served = mc.ModelConfig()
        served.CopyFrom(config)
        served.backend = "onnxruntime"
        served.platform = "onnxruntime_onnx"
        served.default_model_filename = ONNX_FILE
        if "model_path" in served.parameters:
            del served.parameters["model_path"]
        for group in served.instance_group:
            if group.kind == mc.ModelInstanceGroup.KIND_GPU:  # the NPUs it asked for: ONNX Runtime runs on the CPU
                group.kind = mc.ModelInstanceGroup.KIND_CPU
                del group.gpus[:]
        served.parameters[FALLBACK_PARAMETER].string_value = f"served with ONNX Runtime: {reason}"
        logger.warning(
            "model '%s' version %d: backend 'ge' served with ONNX Runtime from %s: %s",
            config.name, version, ONNX_FILE, reason,
        )  # fmt: skip
        return Resolved(served, registry.by_name("onnxruntime"))
