"""Model repository agents run before a model loads: Triton's checksum agent is built in; any other is refused."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from geserve._generated import model_config_pb2 as mc
from geserve.errors import ModelLoadError

CHECKSUM = "checksum"
_ALGORITHMS = {"md5": "MD5"}


def run_agents(config: mc.ModelConfig, model_dir: Path) -> None:
    """Run each agent of `model_repository_agents` on the model folder, in order; raises ModelLoadError."""
    for agent in config.model_repository_agents.agents:
        if agent.name != CHECKSUM:
            raise ModelLoadError(
                f"model '{config.name}': repository agent '{agent.name}' is not available in geserve, "
                f"which runs only the built-in '{CHECKSUM}' agent"
            )
        for key, expected in agent.parameters.items():
            problem = _check(model_dir, key, expected)
            if problem:
                raise ModelLoadError(f"model '{config.name}': {problem}")


def _check(model_dir: Path, key: str, expected: str) -> str | None:
    """One `<ALGORITHM>:<path relative to the model folder>` -> hex digest entry, worded as Triton's agent
    words its failures; None when the file's digest matches."""
    algorithm, separator, relative = key.partition(":")
    if not separator:
        return f"failed to parse key: {key}"
    if algorithm.lower() not in _ALGORITHMS:
        return f"Unsupported checksum algorithm: {algorithm}"
    # Unlike Triton's agent, refuse paths that leave the model folder: the mismatch text would tell a client
    # that can load configs (the repository API) the digest of any file the server can read. The check is on
    # the path as written, so links the repository's owner placed inside the folder are followed, as Triton does.
    normal = os.path.normpath(relative)
    if os.path.isabs(normal) or normal == ".." or normal.startswith(".." + os.sep):
        return f"checksum file {relative} is outside the model folder"
    try:
        digest = _md5_of(model_dir / normal)
    except OSError as error:
        return f"failed to open text file for read {relative}: {os.strerror(error.errno or 0)}"
    if digest != expected:
        name = _ALGORITHMS[algorithm.lower()]
        return f"Mismatched {name} hash for file {relative}, expect: {expected}, got: {digest}"
    return None


def _md5_of(path: Path) -> str:
    """The file's MD5, read a block at a time: model files can be larger than memory."""
    digest = hashlib.md5(usedforsecurity=False)
    with path.open("rb") as file:
        while block := file.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()
