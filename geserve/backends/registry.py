"""Backend names, aliases, platforms and default model files -> lazily imported backend factories."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

from geserve.backends.base import Backend, Capabilities
from geserve.errors import ModelLoadError


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """How to find and build one backend; the module is imported only inside a worker."""

    name: str
    module: str
    default_filename: str
    platforms: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    # A config parameter that names the model file relative to the model's folder.
    path_parameter: str = ""
    # The backend answers a batch request by request (and may stream): it gets each request's details.
    per_request: bool = False
    # The backend copies the next batch to the device while one runs: its workers take two batches at once.
    pipelined: bool = False
    # The backend reports its device's memory and load (DeviceReporter).
    reports_device: bool = False
    # The backend runs the model's own code (ModelHost), which may send BLS requests to the server and wait
    # inside `execute` for their replies: its worker reads the pipe on a thread of its own.
    runs_model_code: bool = False

    def create(self) -> Backend:
        return self.create_typed().backend

    def create_typed(self) -> Capabilities:
        """A fresh backend object, and the same object typed by each optional protocol this entry declares."""
        backend = importlib.import_module(self.module).create_backend()
        return Capabilities(
            backend,
            pipelined=backend if self.pipelined else None,
            per_request=backend if self.per_request else None,
            device=backend if self.reports_device else None,
            model=backend if self.runs_model_code else None,
        )


BACKENDS = (
    BackendSpec("onnxruntime", "geserve.backends.onnxruntime", "model.onnx", platforms=("onnxruntime_onnx",)),
    BackendSpec(
        "ge",
        "geserve.backends.acl",
        "model.om",
        platforms=("ge",),
        aliases=("acl",),
        path_parameter="model_path",
        pipelined=True,
        reports_device=True,
    ),
    BackendSpec("python", "geserve.backends.python", "model.py", per_request=True, runs_model_code=True),
    BackendSpec("identity", "geserve.backends.identity", ""),
)


def by_name(name: str) -> BackendSpec:
    for spec in BACKENDS:
        if name == spec.name or name in spec.aliases:
            return spec
    known = ", ".join(spec.name for spec in BACKENDS)
    raise ModelLoadError(f"unknown backend '{name}' (available backends: {known})")


def resolve(backend: str, platform: str, version_dirs: list[Path], default_filename: str) -> BackendSpec:
    """The backend a config selects: `backend`, else `platform`, else the model file present."""
    if backend:
        return by_name(backend)
    if platform:
        for spec in BACKENDS:
            if platform in spec.platforms:
                return spec
        raise ModelLoadError(f"unknown platform '{platform}'")
    for spec in BACKENDS:
        if not spec.default_filename:
            continue
        candidates = {spec.default_filename}
        if Path(default_filename).suffix == Path(spec.default_filename).suffix:
            candidates.add(default_filename)
        if any((directory / name).exists() for directory in version_dirs for name in candidates):
            return spec
    raise ModelLoadError(
        "unable to determine the backend: the config names no 'backend' or 'platform' and no version "
        f"folder holds a known model file ({', '.join(s.default_filename for s in BACKENDS if s.default_filename)})"
    )
