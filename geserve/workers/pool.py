"""InstancePool: a version's instances (placement, start, idle/busy, restarts, retirement); InstancePools makes them."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from geserve._generated import model_config_pb2 as mc
from geserve.atc import compiler
from geserve.backends import registry
from geserve.errors import ModelLoadError
from geserve.repository import config as config_io
from geserve.repository import ragged
from geserve.repository.scan import ModelSource
from geserve.settings import WorkerSettings
from geserve.types import InstanceStatus
from geserve.workers import placement, rate_limiter
from geserve.workers.batch import Batch
from geserve.workers.bls_serving import ModelCaller
from geserve.workers.client import ThreadWorker, WorkerClient
from geserve.workers.messages import BatchResult, InstanceSpec
from geserve.workers.npu_mode import NpuResolver, Resolved
from geserve.workers.process import ProcessWorker
from geserve.workers.runs import RunId
from geserve.workers.shm import SHM_PREFIX
from geserve.workers.supervisor import RestartPolicy

logger = logging.getLogger(__name__)


class InstancePool:
    """The instances of one model version and which of them can take a batch now. Each instance has
    `capacity` slots; idle slots are interleaved across instances so batches spread before they queue
    on one. A dead instance drops out of the idle slots; once restarted, its slots come back. Passive
    instances (instance_group.passive) are loaded, reported and stopped with the others, but never take a
    batch, as Triton leaves them out of its scheduler."""

    def __init__(
        self,
        instances: Sequence[WorkerClient],
        passive: Sequence[WorkerClient] = (),
        limiter: rate_limiter.RateLimiter | None = None,
    ) -> None:
        self._instances = list(instances)
        self._limiter = limiter  # --rate-limit=execution_count: a batch runs once its instance holds its resources
        self._passive = list(passive)
        self.passive_only = bool(self._passive) and not self._instances
        depth = max((instance.capacity for instance in self._instances), default=1)
        self._idle: deque[WorkerClient] = deque(
            instance for slot in range(depth) for instance in self._instances if slot < instance.capacity
        )
        self._busy: dict[int, int] = {}  # id(instance) -> batches it holds now
        for instance in self._instances:
            instance.on_ready = self._instance_ready
        # Called when a restarted instance's slots are back, so queued work can go to them.
        self.on_idle: Callable[[], None] | None = None
        self.stopped = False  # stop or kill was called: its instances no longer count against the server's cap

    def ready(self) -> bool:
        """An instance is loaded, and its model says it is ready (python models' is_ready()); a version whose
        instances are all passive is ready as Triton's is, though no request can run on it."""
        return any(instance.alive and instance.model_ready for instance in self._everyone)

    @property
    def _everyone(self) -> list[WorkerClient]:
        return self._instances + self._passive

    def recoverable(self) -> bool:
        """An instance is running or on its way back."""
        return any(instance.recoverable for instance in self._instances)

    def has_idle(self) -> bool:
        """Whether `dispatch` can take a batch now."""
        while self._idle and not self._idle[0].alive:
            self._idle.popleft()  # a dead instance leaves the idle slots; the others keep serving
        return bool(self._idle)

    def instance_names(self) -> frozenset[tuple[int, str]]:
        """The (version, instance name) of each instance that takes batches."""
        return frozenset((instance.spec.model_version, instance.spec.instance_name) for instance in self._instances)

    def has_free(self) -> bool:
        """Whether an instance holds no batch at all (else a batch would wait behind a running one)."""
        return self._free_slot() is not None

    def _free_slot(self) -> WorkerClient | None:
        for instance in self._idle:
            if instance.alive and not self._busy.get(id(instance)):
                return instance
        return None

    def dispatch(self, batch: Batch) -> Coroutine[Any, Any, BatchResult]:
        """Claim an idle slot now (call `has_idle` first), on an instance that holds no batch if there is
        one, and return the batch's run, to be awaited."""
        instance = self._free_slot()
        if instance is None:
            instance = self._idle.popleft()
        else:
            self._idle.remove(instance)
        return self._claim(instance, batch)

    def _claim(self, instance: WorkerClient, batch: Batch) -> Coroutine[Any, Any, BatchResult]:
        # Busy from now, not from when the run is first awaited: the scheduler's next decision must see it.
        self._busy[id(instance)] = self._busy.get(id(instance), 0) + 1
        return self._run(instance, batch)

    async def _run(self, instance: WorkerClient, batch: Batch) -> BatchResult:
        try:
            if self._limiter is None:
                return await instance.execute(batch)
            async with self._limiter.held(instance):
                return await instance.execute(batch)
        finally:
            self._busy[id(instance)] -= 1
            self._idle.append(instance)

    # -- one instance at a time (the sequence batcher pins each sequence to one) -------------------

    @property
    def size(self) -> int:
        return len(self._instances)

    def instance_alive(self, index: int) -> bool:
        return self._instances[index].alive

    def incarnation(self, index: int) -> int:
        """Which process of the instance runs now: it changes when a dead one is replaced, state and all."""
        return self._instances[index].incarnation

    def idle_on(self, index: int) -> bool:
        """Whether instance `index` can take a batch now."""
        instance = self._instances[index]
        return instance.alive and instance in self._idle

    def dispatch_to(self, index: int, batch: Batch) -> Coroutine[Any, Any, BatchResult]:
        """`dispatch` to instance `index` (call `idle_on` first)."""
        instance = self._instances[index]
        self._idle.remove(instance)
        return self._claim(instance, batch)

    def _instance_ready(self, instance: WorkerClient) -> None:
        """A restarted instance is back: its free slots rejoin the idle ones and take queued work."""
        held = sum(1 for entry in self._idle if entry is instance) + self._busy.get(id(instance), 0)
        self._idle.extend([instance] * max(instance.capacity - held, 0))
        if self.on_idle is not None:
            self.on_idle()

    async def read_statuses(self) -> list[InstanceStatus]:
        """The status of every instance that reports one (on a device, or a python model)."""
        polled = [instance for instance in self._everyone if instance.spec.polled and instance.alive]
        statuses = await asyncio.gather(*(instance.read_status() for instance in polled))
        return [status for status in statuses if status is not None]

    @property
    def instance_count(self) -> int:
        """Every instance, passive ones too: each is a process."""
        return len(self._everyone)

    async def stop(self, timeout_s: float) -> None:
        self._stopped()
        await asyncio.gather(*(instance.stop(timeout_s) for instance in self._everyone))

    def kill(self) -> None:
        self._stopped()
        for instance in self._everyone:
            instance.kill()

    def _stopped(self) -> None:
        self.stopped = True
        if self._limiter is not None:  # its resources no longer count towards what the others may hold
            for instance in self._instances:
                self._limiter.unregister(instance)


# Each instance is a process: past this many across all loaded models, a load is refused before any starts.
# Triton has no such cap (its instances are threads); geserve caps a model version at 64 as well
# (placement.MAX_INSTANCES_PER_MODEL).
MAX_INSTANCES_PER_SERVER = 256


class InstancePools:
    """Builds started pools from configs and counts every instance they hold against the server's cap: core's
    PoolFactory (core.pool_factory), injected by the server."""

    # Names of the shared-memory segments the workers create (any run's); clients may not register them.
    segment_prefix = SHM_PREFIX

    def __init__(
        self, settings: WorkerSettings, restart: RestartPolicy | None = None, run: RunId | None = None
    ) -> None:
        self._settings = settings
        self._restart = restart
        # The server run every worker's segments belong to (by default this process's).
        self._run = run or RunId.current()
        self._npu = NpuResolver(settings)
        self._compiles = ThreadPoolExecutor(settings.compile_concurrency, thread_name_prefix="geserve-atc")
        self._resolving = 0  # `ge` versions on or waiting for the compile threads
        # Where the instances' BLS requests go: the server sets it once its service exists.
        self.caller: ModelCaller | None = None
        self._pools: list[InstancePool] = []  # every pool it made, until it is stopped
        self._starting = 0  # instances of loads in progress
        # --rate-limit=execution_count: one limiter over every model's instances, as Triton's.
        self._limiter = (
            rate_limiter.RateLimiter(settings.rate_limit_resources)
            if settings.rate_limit == rate_limiter.EXECUTION_COUNT
            else None
        )

    def stop_compiles(self) -> None:
        """The server is stopping: running ATC compiles are killed (their loads fail at once), none starts."""
        compiler.stop_compiles()  # compiles still queued fail as they begin

    def complete(self, config: mc.ModelConfig, source: ModelSource, versions: list[int]) -> None:
        """Select the config's backend and fill the defaults it implies (backend, model file, instance kinds);
        raises ModelLoadError."""
        placement.fill_defaults(config, placement.select_backend(config, source, versions), self._settings)
        ragged.refuse_unsupported(config)  # before any worker starts

    async def create(
        self, source: ModelSource, config: mc.ModelConfig, version: int
    ) -> tuple[InstancePool, mc.ModelConfig]:
        """Start every instance of `version`; returns the pool and the config they serve, which the first
        instance completed from the model file. Raises ModelLoadError; nothing is left running then."""
        settings = self._settings
        # A `ge` version may be compiled from its model.onnx (minutes) or served by ONNX Runtime. Compiles run on
        # their own threads: on the default pool, a few would starve everything else that needs a thread (gzip
        # bodies, response-cache keys, reaping workers, repository polls).
        resolved = await self._resolve(source, config, version)
        config, backend = resolved.config, resolved.backend
        specs = await asyncio.to_thread(placement.instance_specs, source, config, backend, version, settings)
        if resolved.model_path is not None:
            specs = [replace(spec, model_path=str(resolved.model_path)) for spec in specs]
        self._reserve(config.name, version, len(specs))
        try:
            pool, completed = await self._start(specs, backend, version)
        finally:
            self._starting -= len(specs)
        self._pools.append(pool)
        return pool, completed

    def _reserve(self, model: str, version: int, count: int) -> None:
        """Count `count` instances against the server's cap; ModelLoadError when they would pass it."""
        self._pools = [pool for pool in self._pools if not pool.stopped]
        running = sum(pool.instance_count for pool in self._pools) + self._starting
        if running + count > MAX_INSTANCES_PER_SERVER:
            raise ModelLoadError(
                f"model '{model}' version {version} asks for {count} instances, but {running} are running or "
                f"starting and the server's limit is {MAX_INSTANCES_PER_SERVER} instances"
            )
        self._starting += count

    async def _start(
        self, specs: list[InstanceSpec], backend: registry.BackendSpec, version: int
    ) -> tuple[InstancePool, mc.ModelConfig]:
        settings = self._settings
        # The first instance completes the config from the model file; the others load that config as is.
        first = self._worker(specs[0])
        try:
            completed = await first.start()
        except asyncio.CancelledError:
            first.kill()  # a load given up (an unload, a shutdown): a worker stuck in initialize goes with it
            raise
        started: list[WorkerClient] = [first]
        others: list[WorkerClient] = []
        try:
            placement.fill_defaults(completed, backend, settings)
            config_io.validate_config(completed)
            payload = completed.SerializeToString()
            others = [self._worker(replace(item, config=payload, auto_complete=False)) for item in specs[1:]]
            results = await asyncio.gather(*(worker.start() for worker in others), return_exceptions=True)
            started += [w for w, r in zip(others, results, strict=True) if not isinstance(r, BaseException)]
            for result in results:
                if isinstance(result, BaseException):
                    raise result
            scheduled = [worker for worker in started if not worker.spec.passive]
            self._register(completed, scheduled)
        except asyncio.CancelledError:
            for worker in [first, *others]:
                worker.kill()
            raise
        except BaseException:
            await asyncio.gather(*(worker.stop(settings.stop_timeout_s) for worker in started))
            raise
        logger.debug("loaded model '%s' version %d with %d instance(s)", completed.name, version, len(started))
        if not scheduled:
            logger.warning(
                "model '%s' version %d: every instance is passive, so no request can run on it", completed.name, version
            )
        passive = [worker for worker in started if worker.spec.passive]
        return InstancePool(scheduled, passive, self._limiter), completed

    def _register(self, config: mc.ModelConfig, scheduled: list[WorkerClient]) -> None:
        """Give the rate limiter each instance's resources and priority (its group's rate_limiter); a resource
        with fewer copies than an instance names fails the load, as Triton's does, and registers none."""
        if self._limiter is None:
            return
        rate_limiter.check_config(config)
        registered: list[WorkerClient] = []
        try:
            for worker in scheduled:
                group = config.instance_group[worker.spec.group]
                self._limiter.register(worker, rate_limiter.demand_of(group, worker.spec.device_id))
                registered.append(worker)
        except ModelLoadError:
            for worker in registered:
                self._limiter.unregister(worker)
            raise

    async def _resolve(self, source: ModelSource, config: mc.ModelConfig, version: int) -> Resolved:
        backend = registry.by_name(config.backend)
        if backend.name != "ge":  # decided at once: no thread, no queue behind compiles
            return self._npu.resolve(source, config, backend, version)
        slots = self._settings.compile_concurrency
        if self._resolving >= slots:
            logger.info(
                "model '%s' version %d waits to compile: %d 'ge' load(s) ahead (--model-compile-concurrency %d)",
                config.name, version, self._resolving, slots,
            )  # fmt: skip
        cancel = threading.Event()
        self._resolving += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._compiles, self._npu.resolve, source, config, backend, version, cancel
            )
        except asyncio.CancelledError:
            cancel.set()  # the load was given up: its ATC is killed rather than left to run for an hour
            raise
        finally:
            self._resolving -= 1

    def _worker(self, spec: InstanceSpec) -> WorkerClient:
        if self._settings.process_workers:
            return ProcessWorker(
                spec,
                self._settings.arena_bytes,
                restart=self._restart,
                pipeline_depth=self._settings.pipeline_depth or (2 if registry.by_name(spec.backend).pipelined else 1),
                caller=lambda: self.caller,
                run=self._run,
            )
        return ThreadWorker(spec)
