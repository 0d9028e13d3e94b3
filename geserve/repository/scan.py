"""Repository layout: which model folders exist and which version folders a policy selects."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from geserve._generated import model_config_pb2 as mc
from geserve.codecs.digits import is_decimal

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A model folder found in one of the repositories; `config_name` (--model-config-name) picks
    `configs/<name>.pbtxt` over `config.pbtxt` where the folder has it."""

    name: str
    path: Path
    config_name: str = ""


@dataclass(frozen=True, slots=True)
class ScanResult:
    """Models found, and names that cannot be served with the reason why."""

    models: dict[str, ModelSource]
    conflicts: dict[str, str]


def scan_repositories(repositories: list[Path], config_name: str = "") -> ScanResult:
    """List model folders across repositories; a name found in two repositories is unavailable."""
    models: dict[str, ModelSource] = {}
    conflicts: dict[str, str] = {}
    for repository in repositories:
        if not repository.is_dir():
            raise FileNotFoundError(f"model repository '{repository}' does not exist or is not a folder")
        for entry in sorted(repository.iterdir()):
            if not entry.is_dir() or entry.name.startswith("."):
                continue
            if entry.name in models:
                conflicts[entry.name] = (
                    f"model '{entry.name}' appears in multiple repositories: "
                    f"'{models[entry.name].path.parent}' and '{repository}'"
                )
                continue
            models[entry.name] = ModelSource(entry.name, entry, config_name)
    for name in conflicts:
        models.pop(name, None)
    return ScanResult(models, conflicts)


def fingerprint(model_dir: Path) -> tuple[tuple[str, int, int], ...]:
    """What changes when any file of the model folder does: each file's path, size and mtime."""
    entries = []
    for path in sorted(model_dir.rglob("*")):
        if "__pycache__" in path.parts:
            continue
        try:
            stat = path.stat()
        except OSError:
            continue  # removed while walking: the next poll sees the result
        if path.is_file():
            entries.append((str(path.relative_to(model_dir)), stat.st_size, stat.st_mtime_ns))
    return tuple(entries)


def available_versions(model_dir: Path) -> list[int]:
    """Numeric version folders in ascending order; names with a leading zero are ignored, as Triton does."""
    versions = []
    for entry in model_dir.iterdir():
        name = entry.name
        if entry.is_dir() and is_decimal(name) and not name.startswith("0"):
            versions.append(int(name))
    return sorted(versions)


def select_versions(available: list[int], policy: mc.ModelVersionPolicy) -> list[int]:
    """The versions a version_policy serves (latest N by default)."""
    choice = policy.WhichOneof("policy_choice")
    if choice == "all":
        return list(available)
    if choice == "specific":
        wanted = set(policy.specific.versions)
        missing = sorted(wanted - set(available))
        if missing:
            logger.warning("version_policy names versions with no folder: %s", missing)
        return [version for version in available if version in wanted]
    count = policy.latest.num_versions if choice == "latest" else 1
    return available[-max(count, 1) :] if available else []
