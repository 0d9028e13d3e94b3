"""EXECUTION_ENV_PATH: a python model's own environment (conda-pack tarball or folder), unpacked once and checked."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import google.protobuf

import geserve
from geserve._generated import model_config_pb2 as mc
from geserve.errors import ModelLoadError

PARAMETER = "EXECUTION_ENV_PATH"
# Triton replaces this keyword (its first occurrence) with the model's folder.
MODEL_DIRECTORY_KEYWORD = "$$TRITON_MODEL_DIRECTORY"
SERVER_VERSION = sys.version_info[:2]
_PROBE_TIMEOUT_S = 60.0
# What the probe prints, run by the environment's interpreter: its version, its own search path, and whether
# it carries what geserve's worker imports (numpy, as Triton's stub needs it; protobuf, which Triton's does not).
_PROBE = (
    "import importlib.util as u, json, sys\n"
    "def has(name):\n"
    "    try:\n"
    "        return u.find_spec(name) is not None\n"
    "    except ImportError:\n"
    "        return False\n"
    "print(json.dumps({'version': list(sys.version_info[:2]), 'path': [p for p in sys.path if p],"
    " 'numpy': has('numpy'), 'protobuf': has('google.protobuf')}))\n"
)


@dataclass(frozen=True, slots=True)
class ExecutionEnvironment:
    """What a worker needs to run inside an environment: its interpreter, the search path it starts with, and
    the variables its activation would set."""

    root: Path
    interpreter: str
    search_path: tuple[str, ...]
    variables: tuple[tuple[str, str], ...]


def requested_path(config: mc.ModelConfig, model_directory: Path) -> Path | None:
    """The environment a config names, `$$TRITON_MODEL_DIRECTORY` replaced by the model's folder; None without one."""
    parameter = config.parameters.get(PARAMETER)
    if parameter is None or not parameter.string_value:
        return None
    return Path(parameter.string_value.replace(MODEL_DIRECTORY_KEYWORD, str(model_directory), 1))


def prepare(config: mc.ModelConfig, model_directory: Path, cache: Path | None = None) -> ExecutionEnvironment | None:
    """The config's execution environment, unpacked (once, into `cache`) and checked; raises ModelLoadError."""
    path = requested_path(config, model_directory)
    if path is None:
        return None
    model = config.name
    try:
        canonical = path.resolve(strict=True)
    except (OSError, RuntimeError):
        raise ModelLoadError(
            f"model '{model}': Failed to get the canonical path for {path}. ({PARAMETER} names no file or directory)"
        ) from None
    # Checked before anything of the cache is used, for a folder environment too: the runtime links below become
    # the first entries of the worker's search path.
    cache = _private_directory(cache or cache_directory(), model)
    root = canonical if canonical.is_dir() else unpack(canonical, cache, model)
    check_layout_version(root, model)
    interpreter = root / "bin" / "python3"
    if not interpreter.exists():
        raise ModelLoadError(
            f"model '{model}': Path {interpreter} does not exist. The Python environment should contain a "
            f"'python3' interpreter ({PARAMETER} '{path}')"
        )
    probe = probe_interpreter(interpreter, model)
    check_version(probe.version, f"{root} ({interpreter})", model)
    if not probe.numpy:
        raise ModelLoadError(
            f"model '{model}': the Python execution environment {root} has no numpy; the model's worker imports "
            "numpy from the environment, as Triton's python backend stub does: install numpy in it"
        )
    # geserve itself comes first (only its own package), then the environment's path; protobuf, which geserve's
    # worker reads configs with, comes from the server's installation when the environment has none.
    search_path = [str(runtime_path(cache, "geserve", model)), *probe.path]
    if not probe.protobuf:
        search_path.append(str(runtime_path(cache, "google", model)))
    variables = (("PATH", f"{root / 'bin'}{os.pathsep}{os.environ.get('PATH', os.defpath)}"),)
    return ExecutionEnvironment(root, str(interpreter), tuple(search_path), variables)


# -- the cache ---------------------------------------------------------------------------------------------------


def cache_directory(environ: Mapping[str, str] = os.environ) -> Path:
    """Where unpacked environments live: $XDG_CACHE_HOME/geserve/execution-envs, else a private folder of this
    user's in the temporary directory."""
    base = environ.get("XDG_CACHE_HOME", "")
    if base:
        return Path(base) / "geserve" / "execution-envs"
    return Path(tempfile.gettempdir()) / f"geserve-{os.getuid()}" / "execution-envs"


def _is_geserve_folder(path: Path) -> bool:
    return path.name == "geserve" or path.name.startswith("geserve-")


def _private_directory(path: Path, model: str) -> Path:
    """`path`, created if missing, refused unless it is this user's and no one else may write to it: whoever could
    plant an environment there would run code in the server's workers. The folders geserve owns (`path`, and its
    parent when that is geserve's own, as in the default caches) are made private; a parent of the caller's choosing
    is only checked."""
    owned = [path.parent, path] if _is_geserve_folder(path.parent) else [path]
    # Above them lies the user's cache folder or the temporary directory, which are not ours.
    owned[0].parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    for directory in owned:
        _owned_directory(directory, model)
    if len(owned) == 1:
        _check_private(path.parent, path.parent.lstat(), model)
    return path


def _owned_directory(directory: Path, model: str) -> None:
    """`directory`, a folder of geserve's, created or made private (mode 0700): mkdir's mode is cut by the umask and
    applies to the last folder only, so each is created on its own and an existing one of ours is set again (a
    umask of 002 left it group-writable). A link or another user's folder is refused, not changed."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, 0o700)
    try:
        # Opened without following a link, and changed through that descriptor: what was checked is what changes.
        descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:  # a link (ELOOP), or not a folder (ENOTDIR)
        raise _not_private(directory, model) from None
    try:
        status = os.fstat(descriptor)
        if status.st_uid == os.getuid() and stat.S_IMODE(status.st_mode) != 0o700:
            os.fchmod(descriptor, 0o700)
            status = os.fstat(descriptor)
        _check_private(directory, status, model)
    finally:
        os.close(descriptor)


def _check_private(directory: Path, status: os.stat_result, model: str) -> None:
    if stat.S_ISLNK(status.st_mode) or status.st_uid != os.getuid() or status.st_mode & 0o022:
        raise _not_private(directory, model)


def _not_private(directory: Path, model: str) -> ModelLoadError:
    return ModelLoadError(
        f"model '{model}': the execution environment cache {directory} is not a folder of this user's that only it "
        "may write to; remove it or set XDG_CACHE_HOME"
    )


def content_key(archive: Path) -> str:
    """The archive's SHA-256: the same environment unpacks once, a changed one into a folder of its own."""
    digest = hashlib.sha256()
    with archive.open("rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Held by one load at a time, in this process or another (a second server on the same cache)."""
    with path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def unpack(archive: Path, cache: Path, model: str) -> Path:
    """The archive unpacked under `cache`, keyed by its content; unpacked now unless it was before."""
    cache = _private_directory(cache, model)
    try:
        key = content_key(archive)
    except OSError as error:
        raise ModelLoadError(f"model '{model}': {PARAMETER} '{archive}' cannot be read: {error}") from None
    target = cache / key
    with _locked(cache / f"{key}.lock"):
        if target.is_dir():
            _check_private(target, target.lstat(), model)  # unpacked by this user, not planted or linked
            return target
        # Unpacked beside its final name and renamed once complete, so that a crash leaves no half environment.
        staging = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=cache))
        try:
            _extract(archive, staging, model)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _extract(archive: Path, destination: Path, model: str) -> None:
    if not hasattr(tarfile, "data_filter"):  # Python before 3.11.4, without a backport of the extraction filters
        raise ModelLoadError(
            f"model '{model}': this Python cannot unpack {PARAMETER} '{archive}' safely (its tarfile has no extraction "
            "filters, added in 3.11.4): unpack the environment into a folder and name the folder"
        )
    try:
        with tarfile.open(archive) as tar:
            # Every member checked by its name and the archive's own links first: the "data" filter resolves links
            # with os.path.realpath, which stops resolving past PATH_MAX, so a chain of long links gets a member
            # out on Pythons before 3.11.13 / 3.12.11 / 3.13.4 (CVE-2025-4517, python/cpython gh-135034).
            escaping = _escaping_member(tar.getmembers())
            if escaping:
                raise tarfile.FilterError(escaping)
            # The "data" filter still refuses device files, and whatever it finds on disk.
            tar.extractall(destination, filter="data")
    except tarfile.FilterError as error:
        raise ModelLoadError(
            f"model '{model}': {PARAMETER} '{archive}' holds a member that would not stay inside the environment, "
            f"refused: {error}"
        ) from None
    except (tarfile.TarError, EOFError, OSError, ValueError) as error:
        raise ModelLoadError(
            f"model '{model}': {PARAMETER} '{archive}' is not a readable tar archive (conda-pack's .tar.gz or a "
            f"folder is expected): {error}"
        ) from None


# Links followed in resolving one name before giving up, as the kernel's own limit on a path lookup (ELOOP).
_MAX_LINK_HOPS = 40


def _escaping_member(members: list[tarfile.TarInfo]) -> str:
    """Why a member would land, or point, outside the folder it is unpacked into; "" when none would. Decided from
    the names alone (no file system is asked): a member inside a symbolic link of the archive, a link that resolves
    (through the archive's other links) above the folder, a hard link to anything but an earlier file of the
    archive, or a name given twice."""
    links: dict[tuple[str, ...], str] = {}
    files: set[tuple[str, ...]] = set()
    seen: set[tuple[str, ...]] = set()
    for member in members:
        parts = _parts(member.name.lstrip("/"))  # the "data" filter makes an absolute name relative
        if parts is None:
            return f"'{member.name}' leads outside the folder"
        if parts in seen:
            return f"'{member.name}' is in the archive twice"
        seen.add(parts)
        for depth in range(1, len(parts)):
            if parts[:depth] in links:
                return f"'{member.name}' lies inside the link '{'/'.join(parts[:depth])}'"
        if member.issym():
            if member.linkname.startswith("/"):
                return f"'{member.name}' links to the absolute path '{member.linkname}'"
            links[parts] = member.linkname
            if _resolve(parts[:-1], member.linkname, links) is None:
                return f"'{member.name}' links to '{member.linkname}', outside the folder"
        elif member.islnk():
            target = _parts(member.linkname.lstrip("/"))
            if target is None or target not in files:
                return f"'{member.name}' is a hard link to '{member.linkname}', which is no earlier file of the archive"
            files.add(parts)
        elif member.isfile():
            files.add(parts)
    return ""


def _parts(name: str) -> tuple[str, ...] | None:
    """A relative name's components, `.` and `..` applied; None when it climbs above where it starts."""
    parts: list[str] = []
    for part in name.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if not parts:
                return None
            parts.pop()
        else:
            parts.append(part)
    return tuple(parts)


def _resolve(folder: tuple[str, ...], target: str, links: Mapping[tuple[str, ...], str]) -> tuple[str, ...] | None:
    """Where a link in `folder` to `target` leads, following the archive's own links; None when it leads above the
    top, or through more links than a path lookup follows."""
    pending = [part for part in target.split("/") if part not in ("", ".")]
    resolved = list(folder)
    hops = 0
    while pending:
        part = pending.pop(0)
        if part == "..":
            if not resolved:
                return None
            resolved.pop()
            continue
        resolved.append(part)
        link = links.get(tuple(resolved))
        if link is not None:
            hops += 1
            if hops > _MAX_LINK_HOPS or link.startswith("/"):
                return None
            resolved.pop()
            pending[:0] = [piece for piece in link.split("/") if piece not in ("", ".")]
    return tuple(resolved)


def runtime_path(cache: Path, name: str, model: str) -> Path:
    """A folder that holds only a link to the server's package `name` (geserve, or protobuf's `google`), for a
    worker's search path: the server's other packages stay out of the model's sight. `cache` is private (checked by
    the caller); an entry that is not exactly that link is replaced, never trusted."""
    package = Path(geserve.__file__).parent if name == "geserve" else Path(google.protobuf.__file__).parent.parent
    package = package.resolve()
    runtime = cache / "runtime"
    _owned_directory(runtime, model)
    folder = runtime / f"{name}-{hashlib.sha256(str(package).encode()).hexdigest()[:16]}"
    with _locked(runtime / f"{folder.name}.lock"):
        if _links_only_to(folder, name, package):
            return folder
        # Built beside its final name and renamed into place, so that the folder is never seen without its link;
        # an entry in the way (planted, or left by an older geserve) is moved aside first.
        staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=runtime))
        (staging / name).symlink_to(package, target_is_directory=True)
        if folder.is_symlink() or folder.exists():
            stale = Path(tempfile.mkdtemp(prefix=f".{folder.name}.stale.", dir=runtime))
            os.replace(folder, stale / folder.name)
            shutil.rmtree(stale, ignore_errors=True)  # links in it are removed, not followed
        staging.rename(folder)
    return folder


def _links_only_to(folder: Path, name: str, package: Path) -> bool:
    """Whether `folder` is a real folder of this user's, private, holding nothing but `name`, a link to `package`."""
    try:
        status = folder.lstat()
        entries = os.listdir(folder)
        link = folder / name
        return (
            stat.S_ISDIR(status.st_mode)
            and status.st_uid == os.getuid()
            and not status.st_mode & 0o022
            and entries == [name]
            and link.is_symlink()
            and os.readlink(link) == str(package)
        )
    except OSError:
        return False


# -- the interpreter --------------------------------------------------------------------------------------------


def _version_mismatch(found: str, where: str, model: str) -> ModelLoadError:
    server = ".".join(map(str, SERVER_VERSION))
    return ModelLoadError(
        f"model '{model}': the Python execution environment {where} is Python {found}, but geserve runs Python "
        f"{server}: the version of the Python interpreter in the execution environment must match the server's "
        f"(major.minor, as Triton's must match its python backend stub); build the environment with Python {server}"
    )


def check_layout_version(root: Path, model: str) -> None:
    """An environment's lib/pythonX.Y tells its version before anything of it runs."""
    versions = sorted(path.name.removeprefix("python") for path in root.glob("lib/python3.*") if path.is_dir())
    server = ".".join(map(str, SERVER_VERSION))
    if versions and server not in versions:
        raise _version_mismatch(", ".join(versions), f"{root} (lib/python{versions[0]})", model)


def check_version(version: tuple[int, ...], where: str, model: str) -> None:
    if version[:2] != SERVER_VERSION:
        raise _version_mismatch(".".join(map(str, version[:2])), where, model)


@dataclass(frozen=True, slots=True)
class Probe:
    """What an environment's interpreter says of itself."""

    version: tuple[int, ...]
    path: tuple[str, ...]
    numpy: bool
    protobuf: bool


def probe_interpreter(interpreter: Path, model: str) -> Probe:
    """Run the environment's interpreter once: its version, search path and packages. Ignoring PYTHON* variables
    and the user's site-packages, as Triton's documentation asks of environments (PYTHONNOUSERSITE)."""
    try:
        result = subprocess.run(
            [str(interpreter), "-E", "-s", "-c", _PROBE],
            capture_output=True,
            text=True,
            timeout=_PROBE_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise ModelLoadError(
            f"model '{model}': the environment's interpreter {interpreter} cannot run: {error}"
        ) from None
    try:
        answer = json.loads(result.stdout.strip().splitlines()[-1])
        return Probe(
            tuple(int(part) for part in answer["version"]),
            tuple(str(entry) for entry in answer["path"]),
            bool(answer["numpy"]),
            bool(answer["protobuf"]),
        )
    except (ValueError, KeyError, IndexError, TypeError):
        detail = (result.stderr.strip() or result.stdout.strip())[-500:]
        raise ModelLoadError(
            f"model '{model}': the environment's interpreter {interpreter} did not run as a Python "
            f"{'.'.join(map(str, SERVER_VERSION))} interpreter (exit status {result.returncode}): {detail}"
        ) from None
