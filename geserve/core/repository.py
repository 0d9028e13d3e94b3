"""The loaded models, and loading, reloading and unloading them under Triton's model control modes."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import json
import logging
import shutil
import tempfile
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from google.protobuf import json_format

from geserve._generated import model_config_pb2 as mc
from geserve.abandonable import AbandonableExecutor
from geserve.core.api import FILE_PREFIX
from geserve.core.ensemble import is_ensemble, steps_of
from geserve.core.loader import load_model
from geserve.core.models import Model, ModelVersion
from geserve.core.pool_factory import PoolFactory
from geserve.errors import InternalError, InvalidArgumentError, ModelLoadError, UnavailableError
from geserve.repository import config as config_io
from geserve.repository.remote import RemoteRepositoryError, S3Mirror, mount_root, parse_s3_url
from geserve.repository.scan import ModelSource, ScanResult, fingerprint, scan_repositories
from geserve.settings import ControlMode, RepositorySettings

logger = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

EXPLICIT_ONLY = "explicit model load / unload is not allowed if polling is enabled"

# The repository's own threads (scans, the object store's listings and downloads): never the loop's default pool,
# which requests' work off the loop (BYTES validation, large copies) uses, so a store that hangs delays no request.
# Syncs take one at a time (`_sync_turn`), so however long the store hangs the others stay free for scans.
REPOSITORY_THREADS = 4


def check_model_name(name: str) -> None:
    """Names come from clients: refuse anything that could leave the repository."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\x00" in name:
        raise InvalidArgumentError(
            f"invalid model name '{name}': model names must not be empty or contain path traversal characters"
        )


class ModelRepository:
    """Owns `models`. A (re)load builds the new versions next to the old ones, switches traffic to them
    only once they are ready, and drains the old ones before stopping them; a failed reload leaves the
    old model serving."""

    def __init__(
        self,
        settings: RepositorySettings,
        pools: PoolFactory,
        stop_timeout_s: float = 30.0,
    ) -> None:
        self.repositories = list(settings.paths)
        self._config_name = settings.config_name  # --model-config-name
        self._remote_urls = settings.remotes
        self._named = ", ".join([*map(str, settings.paths), *settings.remotes])  # as the command line gave them
        self._mirrors: list[S3Mirror] = []  # made at startup, their folders added to `repositories`
        self._mirror_root: Path | None = None  # a temporary folder of ours, removed at shutdown
        # Daemon threads: a call hung in the store is abandoned at exit, not waited out after SIGTERM.
        self._io = AbandonableExecutor(REPOSITORY_THREADS, thread_name_prefix="geserve-repository")
        # One sync at a time (index, poll and load may overlap), waited for on the loop rather than on a thread.
        self._sync_turn = asyncio.Lock()
        self._listed = False  # every remote repository listed at least once: the index can answer from its copy
        self._refresh: asyncio.Task[None] | None = None  # the index's listing of the store under way, if any
        # The last failed poll's (or listing's) message and whether it was the store's; None once one succeeds.
        self._read_failure: tuple[str, bool] | None = None
        self._pools = pools
        self._stop_timeout_s = stop_timeout_s
        self.mode = settings.control_mode
        self.startup_models = settings.startup_models
        self.poll_secs = settings.poll_secs
        self.models: dict[str, Model] = {}
        self.listeners: list[Callable[[ModelVersion], None]] = []
        # Called whenever the models served change (a load, reload or unload): protocol processes hear of it.
        self.on_change: list[Callable[[], None]] = []
        self._locks: dict[str, asyncio.Lock] = {}
        self._loading: set[str] = set()
        # Each model's load in progress, so that an unload or the shutdown can give it up (a warmup or an initialize
        # that never returns would otherwise hold both for ever).
        self._load_tasks: dict[str, asyncio.Task[Model]] = {}
        self._fingerprints: dict[str, tuple[Any, ...]] = {}
        self._override_dirs: dict[str, Path] = {}
        self._retiring: set[asyncio.Task[None]] = set()
        self._poller: asyncio.Task[None] | None = None

    # -- startup and polling -------------------------------------------------------------------

    async def load_startup(self) -> dict[str, str]:
        """The models the mode loads at start; returns the failures as name -> reason."""
        await self._off_loop(self._make_mirrors)
        explicit = self.mode is ControlMode.EXPLICIT and "*" not in self.startup_models
        wanted = set(self.startup_models)
        scan = await self._scan(wanted if explicit else None)
        while explicit:
            # An ensemble named by --load-model brings the models its steps use, as loading it through the
            # repository API does (and theirs, for an ensemble of ensembles).
            # Only the named models' own steps: the scan lists every model of a local repository.
            named = [scan.models[name] for name in sorted(wanted) if name in scan.models]
            composing = [await self._off_loop(_composing_models, source) for source in named]
            more = {name for names in composing if names for name in names} - wanted
            if not more:
                break
            wanted |= more
            scan = await self._scan(wanted)
        for name, reason in scan.conflicts.items():
            logger.error("failed to load '%s': %s", name, reason)
            self._set(name, Model(name, reason=reason))
        sources = scan.models
        if self.mode is ControlMode.EXPLICIT and "*" not in self.startup_models:
            missing = [name for name in self.startup_models if name not in sources]
            for name in missing:
                logger.error("failed to load '%s': no such model in the repository", name)
                self._set(name, Model(name, reason=f"failed to load '{name}', failed to poll from model repository"))
            sources = {name: source for name, source in sources.items() if name in wanted}
        # Loading takes seconds to minutes (ATC compiles take longer): say so before the first model is ready.
        logger.info("loading %d model(s) from %s", len(sources), self._named)
        steps = {name: await self._off_loop(_composing_models, source) for name, source in sources.items()}
        # Composing models first, then each ensemble once the models it uses have been tried.
        await asyncio.gather(*(self._load_source(source) for name, source in sources.items() if steps[name] is None))
        waiting = {name: set(composing or ()) for name, composing in steps.items() if composing is not None}
        while waiting:
            tried = set(sources) - set(waiting)
            ready = [name for name, needs in waiting.items() if needs <= tried or not needs & set(waiting)]
            for name in ready or sorted(waiting):  # a cycle between ensembles: each fails naming what it lacks
                del waiting[name]
                await self._load_source(sources[name])
        return {name: model.reason for name, model in sorted(self.models.items()) if model.reason}

    def start_polling(self) -> None:
        if self.mode is ControlMode.POLL:
            self._poller = asyncio.get_running_loop().create_task(self._poll_forever())

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_secs)
            try:
                await self.poll()
            except Exception as error:
                self._read_failed("polling the model repository", error)
            else:
                self._read_worked()

    def _read_failed(self, doing: str, error: Exception) -> None:
        """One line when polls (or the index's listings) start failing and when the error changes, not one every
        poll: a store down for an hour would otherwise fill the log."""
        store = isinstance(error, RemoteRepositoryError)
        message = str(error) if isinstance(error, OSError) else f"{type(error).__name__}: {error}"
        if self._read_failure == (message, store):
            return
        self._read_failure = (message, store)
        # The store's and the file system's errors say all there is; anything else is a fault of ours: its traceback.
        logger.error("%s failed: %s", doing, message, exc_info=not isinstance(error, OSError))

    def _read_worked(self) -> None:
        if self._read_failure is not None:
            _, store = self._read_failure
            self._read_failure = None
            logger.info("object storage reachable again" if store else "polling the model repository works again")

    async def poll(self) -> None:
        """Load new models, reload changed ones, unload removed ones."""
        scan = await self._scan(None)
        for name, source in scan.models.items():
            current = await self._off_loop(fingerprint, source.path)
            if name not in self.models or self._fingerprints.get(name) != current:
                logger.info("model '%s' %s in the repository", name, "changed" if name in self.models else "appeared")
                await self._load_source(source)
        for name in [name for name in self.models if name not in scan.models and name not in scan.conflicts]:
            if self.models[name].versions:
                logger.info("model '%s' left the repository", name)
                await self.unload(name, api=False)

    def _make_mirrors(self) -> None:
        """The local folders the remote repositories are copied into: under TRITON_AWS_MOUNT_DIRECTORY as Triton's,
        else in a temporary folder removed at shutdown."""
        if not self._remote_urls or self._mirrors:
            return
        root = mount_root()
        if root is None:
            root = self._mirror_root = Path(tempfile.mkdtemp(prefix="geserve-repository-"))
        for index, url in enumerate(self._remote_urls):
            mirror = S3Mirror(url, root / f"{index}-{parse_s3_url(url).bucket}")
            self._mirrors.append(mirror)
            self.repositories.append(mirror.local)

    async def _scan(self, models: Collection[str] | None) -> ScanResult:
        """Scan every repository, the remote ones' copies first brought up to date for `models` (None: all of
        them; empty: only which models there are). Off the event loop: the store is read over the network."""
        await self._sync(models)
        return await self._off_loop(scan_repositories, self.repositories, self._config_name)

    async def _sync(self, models: Collection[str] | None) -> None:
        """Bring the remote repositories' copies up to date for `models`. The turn is given back when the sync's
        thread is done, not when its caller is cancelled: so at most one of the repository's threads is ever in the
        store, and syncs waiting their turn hold none."""
        if not self._mirrors:
            return
        await self._sync_turn.acquire()
        try:
            future = self._io.submit(contextvars.copy_context().run, self._sync_mirrors, models)
        except BaseException:
            self._sync_turn.release()
            raise
        loop = asyncio.get_running_loop()

        def done(_: Future[None]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nothing waits for the turn
                loop.call_soon_threadsafe(self._sync_turn.release)

        future.add_done_callback(done)
        await asyncio.wrap_future(future)
        self._listed = True

    def _sync_mirrors(self, models: Collection[str] | None) -> None:
        for mirror in self._mirrors:
            mirror.sync(models)

    def _refresh_listing(self) -> None:
        """List the store in the background, unless a sync is under way already (that one lists it too): the index
        answers from the last listing meanwhile, and a store that cannot be read leaves that listing in place."""
        if self._mirrors and self._refresh is None and not self._sync_turn.locked():
            self._refresh = asyncio.get_running_loop().create_task(self._list_store())

    async def _list_store(self) -> None:
        try:
            await self._sync(())
        except Exception as error:
            self._read_failed("listing the model repository", error)  # the next index call tries again
        else:
            self._read_worked()
        finally:
            self._refresh = None

    async def _off_loop(self, work: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`work` on the repository's threads (with the caller's context, as asyncio.to_thread gives it)."""
        call = functools.partial(contextvars.copy_context().run, work, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._io, call)

    # -- the repository API --------------------------------------------------------------------

    async def load(self, name: str, parameters: Mapping[str, Any] | None = None) -> None:
        """Load or reload `name`; `parameters` may hold a `config` JSON string and `file:<path>` contents."""
        if self.mode is not ControlMode.EXPLICIT:
            raise UnavailableError(EXPLICIT_ONLY)
        check_model_name(name)
        parameters = dict(parameters or {})
        config_text = parameters.pop("config", None)
        files = {key[len(FILE_PREFIX) :]: value for key, value in parameters.items() if key.startswith(FILE_PREFIX)}
        override = _config_override(name, config_text) if config_text is not None else None
        if files:
            if override is None:
                raise InvalidArgumentError(f"failed to load '{name}': file overrides need a 'config' parameter too")
            source = await self._off_loop(self._write_override_folder, name, files)
        else:
            try:
                scan = await self._scan({name})
            except RemoteRepositoryError as error:  # the model stays as it was: serving, or not
                raise InternalError(f"failed to load '{name}', {error}") from None
            found = scan.models.get(name)
            if found is None:
                if name in scan.conflicts:
                    raise InvalidArgumentError(f"failed to load '{name}', {scan.conflicts[name]}")
                # Triton's text and code (INTERNAL) for a name the repository does not hold.
                raise InternalError(f"failed to load '{name}', failed to poll from model repository")
            source = found
            # Loading an ensemble loads the models it uses that are not loaded yet, as Triton does.
            wanted = [
                composing
                for composing in await self._off_loop(_composing_models, source) or ()
                if composing != name and not self._serving(composing)
            ]
            if wanted and self._mirrors:
                try:
                    scan = await self._scan(set(wanted))
                except RemoteRepositoryError as error:
                    raise InternalError(f"failed to load '{name}', {error}") from None
            for composing in wanted:
                if composing in scan.models:
                    await self._load_source(scan.models[composing])
        model = await self._load_source(source, override)
        if model.reason:
            raise InvalidArgumentError(f"failed to load '{name}', {model.reason}")

    async def unload(self, name: str, unload_dependents: bool = False, api: bool = True, wait: bool = True) -> None:
        """Stop serving `name`: requests already admitted finish first (before this returns, with `wait`). With
        `unload_dependents`, an ensemble's composing models go too, unless another loaded ensemble still uses them."""
        if api and self.mode is not ControlMode.EXPLICIT:
            raise UnavailableError(EXPLICIT_ONLY)
        check_model_name(name)
        loading = self._load_tasks.get(name)
        if loading is not None:
            # Loading or warming up: given up at once (its workers killed), rather than waited for.
            logger.info("unloading '%s' while it loads: the load is given up", name)
            loading.cancel()
        composing = self._composing_of(name) if unload_dependents else ()
        await self._unload_one(name, wait)
        for dependent in composing:
            users = [other for other in self.models if other != name and dependent in self._composing_of(other)]
            if not users:
                await self._unload_one(dependent, wait)

    def _serving(self, name: str) -> bool:
        model = self.models.get(name)
        return model is not None and bool(model.versions)

    def _composing_of(self, name: str) -> tuple[str, ...]:
        """The models a loaded ensemble's steps use (none for other models)."""
        model = self.models.get(name)
        if model is None:
            return ()
        return tuple(
            dict.fromkeys(step.model_name for version in model.versions.values() for step in steps_of(version.config))
        )

    async def _unload_one(self, name: str, wait: bool = True) -> None:
        async with self._lock(name):
            old = self.models.get(name)
            if old is None or (old.unloaded and not old.versions):
                return
            self._set(name, Model(name, unloaded=True, unloaded_versions=tuple(sorted(old.versions))))
            self._fingerprints.pop(name, None)
        if wait:
            await self._finish_unload(name, old)
            return
        task = asyncio.get_running_loop().create_task(self._finish_unload(name, old))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _finish_unload(self, name: str, old: Model) -> None:
        await self._retire(old, wait=True)
        self._drop_override_folder(name)

    async def index(self, ready_only: bool = False) -> list[dict[str, str]]:
        """Every model of the repositories and every one loaded, with its versions' states. Remote repositories
        are listed from their last listing, never waiting on the store once there is one: polls keep it up to date
        in POLL mode, otherwise each call starts a listing for the next one."""
        try:
            if not self._listed:
                await self._sync(())  # nothing listed yet (a startup that failed): the store's answer is awaited
            elif self.mode is not ControlMode.POLL:
                self._refresh_listing()
            scan = await self._off_loop(scan_repositories, self.repositories, self._config_name)
        except RemoteRepositoryError as error:
            raise InternalError(str(error)) from None
        entries: list[dict[str, str]] = []
        for name in sorted(set(scan.models) | set(scan.conflicts) | set(self.models)):
            model = self.models.get(name)
            if name in self._loading:
                entries.append({"name": name, "state": "LOADING"})
            elif model is None:
                entries.append({"name": name})
            elif model.versions:
                for number in sorted(model.versions):
                    version = model.versions[number]
                    state = "READY" if version.ready else "UNAVAILABLE"
                    entry = {"name": name, "version": str(number), "state": state}
                    if version.npu_fallback:  # a `ge` version on ONNX Runtime says so where operators look
                        entry["reason"] = version.npu_fallback
                    entries.append(entry)
            elif model.unloaded:
                if not model.unloaded_versions:
                    entries.append({"name": name, "state": "UNAVAILABLE", "reason": "unloaded"})
                for number in model.unloaded_versions:
                    entries.append({"name": name, "version": str(number), "state": "UNAVAILABLE", "reason": "unloaded"})
            else:
                entries.append({"name": name, "state": "UNAVAILABLE", "reason": model.reason})
        if ready_only:
            entries = [entry for entry in entries if entry.get("state") == "READY"]
        return entries

    # -- loading and retiring ------------------------------------------------------------------

    def _set(self, name: str, model: Model) -> None:
        self.models[name] = model
        for listener in self.on_change:
            listener()

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    async def _load_source(self, source: ModelSource, override: mc.ModelConfig | None = None) -> Model:
        async with self._lock(source.name):
            self._loading.add(source.name)
            try:
                current = await self._off_loop(fingerprint, source.path)
                loading = asyncio.ensure_future(load_model(source, self._pools, override, self.models))
                self._load_tasks[source.name] = loading
                try:
                    model = await loading
                except asyncio.CancelledError:
                    if not loading.cancelled() or _cancelling():
                        raise  # this load's caller was cancelled (the server stops): not a load given up
                    model = Model(source.name, reason="unloaded while loading")
            finally:
                self._loading.discard(source.name)
                self._load_tasks.pop(source.name, None)
            old = self.models.get(source.name)
            if model.reason and old is not None and old.versions:
                logger.error("reloading '%s' failed; the loaded version(s) keep serving: %s", source.name, model.reason)
                self._fingerprints[source.name] = current  # do not retry the same files every poll
                return model
            if model.reason:
                logger.error("failed to load '%s': %s", source.name, model.reason)
            self._set(source.name, model)
            self._fingerprints[source.name] = current
            for version in model.versions.values():
                for listener in self.listeners:
                    listener(version)
            for number, version in sorted(model.versions.items()):
                # Triton's words, which readiness scripts wait for ("successfully loaded '<model>'"), then geserve's.
                logger.info("successfully loaded '%s' version %d (%s)", source.name, number, _served_by(version))
        if old is not None and old is not model:
            await self._retire(old, wait=False)
        return model

    async def _retire(self, old: Model, wait: bool) -> None:
        """Let the old versions finish what they admitted, then stop their workers."""
        if not old.versions:
            return
        task = asyncio.get_running_loop().create_task(self._stop_versions(list(old.versions.values())))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)
        if wait:
            await task

    async def _stop_versions(self, versions: list[ModelVersion]) -> None:
        await asyncio.gather(*(version.stop(self._stop_timeout_s) for version in versions))

    def _write_override_folder(self, name: str, files: Mapping[str, bytes]) -> ModelSource:
        """A fresh temporary model folder holding only the given files; paths must stay inside it."""
        root = Path(tempfile.mkdtemp(prefix="geserve-model-")).resolve()
        folder = root / name
        folder.mkdir()
        try:
            for relative, content in files.items():
                _check_override_path(name, relative)
                target = (folder / relative).resolve()
                if not relative or not target.is_relative_to(folder) or target == folder:
                    raise InvalidArgumentError(
                        f"failed to load '{name}': file override '{FILE_PREFIX}{relative}' must name a file inside "
                        "the model folder"
                    )
                try:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(content)
                except OSError as error:  # the message names the file as the client did, not our folder
                    raise InvalidArgumentError(
                        f"failed to load '{name}': file override '{FILE_PREFIX}{relative}' cannot be written: "
                        f"{error.strerror or type(error).__name__}"
                    ) from None
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise
        self._drop_override_folder(name)
        self._override_dirs[name] = root
        return ModelSource(name, folder)

    def _drop_override_folder(self, name: str) -> None:
        root = self._override_dirs.pop(name, None)
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)

    async def shutdown(self, timeout_s: float | None = None) -> None:
        """Stop every version within `timeout_s` (by default the stop timeout, --exit-timeout-secs)."""
        timeout_s = self._stop_timeout_s if timeout_s is None else timeout_s
        for background in (self._poller, self._refresh):
            if background is not None:
                background.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await background
        # Loads still in progress are given up: their workers are killed, not warmed up or waited for.
        loading = list(self._load_tasks.values())
        for task in loading:
            task.cancel()
        await asyncio.gather(*loading, return_exceptions=True)
        versions = [version for model in self.models.values() for version in model.versions.values()]
        await asyncio.gather(*(version.stop(timeout_s) for version in versions), *self._retiring)
        for name in list(self._override_dirs):
            self._drop_override_folder(name)
        # A sync stuck in a store that hangs is not waited for, here or at exit: its thread is a daemon.
        self._io.shutdown(wait=False, cancel_futures=True)
        if self._mirror_root is not None:
            shutil.rmtree(self._mirror_root, ignore_errors=True)


# Limits of Linux file systems, checked before anything is written: one name, a whole path, and depth.
_MAX_NAME_BYTES = 255
_MAX_PATH_BYTES = 1024
_MAX_DEPTH = 32


def _cancelling() -> bool:
    """Whether the running task itself is being cancelled (not only something it awaited)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _served_by(version: ModelVersion) -> str:
    """What the ready line says serves a version: its backend and how many instances, or that it is an ensemble."""
    config = version.config
    if is_ensemble(config):
        return "ensemble"
    count = version.instance_count
    return f"{config.backend or config.platform}, {count} instance{'' if count == 1 else 's'}"


def _composing_models(source: ModelSource) -> tuple[str, ...] | None:
    """The models an ensemble's steps name, read from its config.pbtxt; None for a model that is not an ensemble
    (or whose config cannot be read: its load reports why)."""
    try:
        config, _ = config_io.read_model_config(source.path, source.name, source.config_name)
    except ModelLoadError:
        return None
    if not is_ensemble(config):
        return None
    return tuple(dict.fromkeys(step.model_name for step in steps_of(config)))


def _check_override_path(name: str, relative: str) -> None:
    """A `file:` override path a file system can hold, refused as Triton refuses it (in the client's own words)
    otherwise."""
    shown = f"{FILE_PREFIX}{relative[:64]}{'...' if len(relative) > 64 else ''}"
    problem = ""
    if "\x00" in relative:
        problem = "contains a NUL character"
    elif len(relative.encode("utf-8", "surrogatepass")) > _MAX_PATH_BYTES:
        problem = f"is longer than {_MAX_PATH_BYTES} bytes"
    elif relative.count("/") >= _MAX_DEPTH:
        problem = f"is more than {_MAX_DEPTH} folders deep"
    elif any(len(part.encode("utf-8", "surrogatepass")) > _MAX_NAME_BYTES for part in relative.split("/")):
        problem = f"has a file or folder name longer than {_MAX_NAME_BYTES} bytes"
    if problem:
        # Triton fails these while it writes the overrides out to poll them: INTERNAL, "failed to poll from model
        # repository" (its own simple_grpc_model_control example expects both).
        raise InternalError(
            f"failed to load '{name}', failed to poll from model repository: file override '{shown}' {problem}"
        )


def _config_override(name: str, text: Any) -> mc.ModelConfig:
    """The `config` load parameter: ModelConfig JSON; numeric strings are accepted for integer fields."""
    config = mc.ModelConfig()
    try:
        if not isinstance(text, str):
            raise TypeError("the 'config' parameter must be a string")
        if text.strip():
            if not isinstance(json.loads(text), dict):
                raise TypeError("the 'config' parameter must be a JSON object")
            json_format.Parse(text, config)
    except (json_format.ParseError, TypeError, ValueError, RecursionError) as error:
        raise InvalidArgumentError(
            f"failed to load '{name}', the 'config' parameter is not a model config: {error}"
        ) from None
    if config.name and config.name != name:
        raise InvalidArgumentError(f"failed to load '{name}', the 'config' parameter names model '{config.name}'")
    config.name = name
    return config
