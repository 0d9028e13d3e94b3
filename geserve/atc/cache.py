"""The compiled-model cache: one folder per (ONNX bytes, ATC command, chip, CANN version), published atomically."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from geserve.atc.command import AtcCommand

MODEL_FILE = "model.om"
_KEY_VERSION = 3  # bump when what an entry holds, or what the key is made of, changes
_STAGING_PREFIX = ".compiling-"


def default_dir(environ: dict[str, str] | None = None) -> Path:
    """`$XDG_CACHE_HOME/geserve/om`, else `~/.cache/geserve/om`."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "geserve" / "om"


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def key(onnx: Path, command: AtcCommand, soc: str, cann: str, opp: str = "") -> str:
    """What decides the `.om` ATC writes: a changed ONNX file, option, option file, chip, CANN or operator package
    (`opp`: the kernels ATC builds the graph's operators from, upgraded on their own) recompiles."""
    material = {
        "opp": opp,
        "version": _KEY_VERSION,
        "onnx": file_digest(onnx),
        "arguments": list(command.key_arguments),
        "files": [file_digest(path) for path in command.files],
        "soc": soc,
        "cann": cann,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def entry(cache_dir: Path, model: str, digest: str) -> Path:
    return cache_dir / f"{model}-{digest[:32]}"


def lookup(folder: Path) -> Path | None:
    om = folder / MODEL_FILE
    return om if om.is_file() else None


def staging(cache_dir: Path, abandoned_after_s: float) -> Path:
    """A private folder beside the entries, so publishing it is a rename on the same file system. Folders a
    killed server left behind (older than any compile may run) are removed first."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    now = time.time()
    for folder in cache_dir.glob(f"{_STAGING_PREFIX}*"):
        try:
            if now - folder.stat().st_mtime > abandoned_after_s:
                shutil.rmtree(folder, ignore_errors=True)
        except OSError:  # another server removed it meanwhile
            continue
    return Path(tempfile.mkdtemp(prefix=_STAGING_PREFIX, dir=cache_dir))


def publish(staged: Path, folder: Path) -> Path:
    """Rename the staged folder into place: readers see a whole entry or none. Another server that got there
    first wins; its entry is as good as ours (same key). The entry is made readable by everyone first: mkdtemp
    made it private (0700), and servers of other users sharing the cache (or a server run as another user than
    the `geserve compile` that filled it) must read it."""
    for path in staged.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    staged.chmod(0o755)
    try:
        staged.rename(folder)
    except OSError:
        if lookup(folder) is None:
            raise
        shutil.rmtree(staged, ignore_errors=True)
    return folder / MODEL_FILE
