"""Which runtime serves a `ge` model version: its `.om`, an `.om` compiled from its model.onnx, or ONNX Runtime."""

from __future__ import annotations

import enum
import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from geserve._generated import model_config_pb2 as mc
from geserve.atc import cache, compiler, host
from geserve.backends import registry
from geserve.errors import ModelLoadError
from geserve.repository.scan import ModelSource
from geserve.settings import WorkerSettings
from geserve.types import NPU_FALLBACK_PARAMETER
from geserve.workers.placement import model_file_path

logger = logging.getLogger(__name__)

ONNX_FILE = "model.onnx"
# Where CANN's environment script is: /usr/local/Ascend/cann/ from CANN 8.5, /usr/local/Ascend/ascend-toolkit/ before.
SET_ENV_HINT = "/usr/local/Ascend/cann/set_env.sh, or /usr/local/Ascend/ascend-toolkit/set_env.sh before CANN 8.5"
# Shown in the served config (GET /v2/models/<m>/config) when a `ge` model runs on ONNX Runtime: why.
FALLBACK_PARAMETER = NPU_FALLBACK_PARAMETER


class NpuMode(enum.StrEnum):
    AUTO = "auto"  # the NPU; ONNX Runtime for models that ship model.onnx only on a host without the Ascend driver
    REQUIRED = "required"  # the NPU or a failed load
    OFF = "off"  # ONNX Runtime for every `ge` model with a model.onnx


@dataclass(frozen=True, slots=True)
class NpuProblem:
    """Why `ge` models cannot run on an NPU; `no_npu` when the host has none at all (the only case `auto` falls
    back to ONNX Runtime for)."""

    reason: str
    no_npu: bool = False


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

    def __init__(self, settings: WorkerSettings, probe_driver: Callable[[], str | None] = host.ascend_driver) -> None:
        self._settings = settings
        self._probe_driver = probe_driver

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
        problem = self._npu_problem()
        if problem is not None:
            if mode is NpuMode.REQUIRED:
                raise ModelLoadError(f"{where}: --npu=required, but {problem.reason}")
            if not has_onnx:  # nothing to fall back to: the .om fails to load, saying why, as it always has
                return Resolved(config, backend)
            if problem.no_npu:
                return self._fallback(config, version, problem.reason)
            # NPUs are here but cannot be used: serving on the CPU would hide a broken setup behind a ready server.
            raise ModelLoadError(
                f"{where}: {problem.reason}; --npu=off serves model.onnx with ONNX Runtime if that is what you want"
            )
        if has_om(source, config, backend, version) or not has_onnx:
            return Resolved(config, backend)
        atc = host.find_atc()
        if atc is None:
            cached = self._cached(config, onnx, source)
            if cached is not None:
                return Resolved(config, backend, cached)
            reason = (
                "the version folder holds model.onnx and no .om, and CANN's atc is not on PATH to compile it "
                f"(source CANN's set_env.sh: {SET_ENV_HINT}; or ship the .om)"
            )
            if mode is NpuMode.REQUIRED:
                raise ModelLoadError(f"{where}: --npu=required, but {reason}")
            raise ModelLoadError(f"{where}: {reason}; --npu=off serves model.onnx with ONNX Runtime instead")
        tools = compiler.Toolchain(
            atc,
            self._chip,
            host.cann_version(atc=atc),
            self.cache_dir,
            python=self._settings.atc_python,
            opp=host.opp_version(atc=atc),
        )
        compiled = compiler.compile_version(config, onnx, source.path, tools, cancel)
        return Resolved(config, backend, compiled.om)

    def _cached(self, config: mc.ModelConfig, onnx: Path, source: ModelSource) -> Path | None:
        """What `geserve compile` cached for this chip or a sibling: an image without atc still serves it."""
        try:
            chip = self._chip
        except ModelLoadError:
            return None  # pyACL cannot name the chip: nothing to look up by
        lookup = compiler.Toolchain("", chip, host.cann_version(), self.cache_dir, opp=host.opp_version())
        found = compiler.find_compiled(config, onnx, source.path, lookup)
        return found.om if found is not None else None

    @property
    def cache_dir(self) -> Path:
        return self._settings.model_cache_dir or cache.default_dir()

    def _npu_problem(self) -> NpuProblem | None:
        """Why `ge` models cannot run on an NPU here, or None. Only a host without the Ascend driver has no NPU
        (`auto` falls back there); NPUs this server cannot use (no pyACL, none visible to it) are a setup to fix."""
        driver = self._driver
        if not self._settings.device_ids:
            if driver is None:
                return NpuProblem("this host has no NPU (no /dev/davinci* device and no Ascend driver)", no_npu=True)
            return NpuProblem(
                f"the Ascend driver is here ({driver}) but this server sees no NPU: give the container an NPU "
                "(the pod's huawei.com/Ascend* resource, or --device /dev/davinciN), and check "
                "ASCEND_RT_VISIBLE_DEVICES and --device-ids"
            )
        if not host.has_pyacl():
            seen = driver or f"--device-ids {','.join(map(str, self._settings.device_ids))}"
            return NpuProblem(
                f"this host has NPUs ({seen}) but pyACL cannot be imported: install CANN and source its set_env.sh "
                f"({SET_ENV_HINT}) before starting geserve"
            )
        return None

    @functools.cached_property
    def _driver(self) -> str | None:
        return self._probe_driver()

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
