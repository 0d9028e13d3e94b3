"""ProcessWorker: an instance in a spawned process, fed through its arenas, supervised when it dies."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

from geserve._generated import model_config_pb2 as mc
from geserve.errors import GeserveError, ModelLoadError, UnavailableError
from geserve.residency import Lease
from geserve.settings import DEFAULT_ARENA_BYTES
from geserve.types import CallChain, InstanceStatus, with_parameters
from geserve.workers.arenas import Arenas
from geserve.workers.batch import Batch, Cancellable
from geserve.workers.bls_serving import BlsServer, ModelCaller
from geserve.workers.client import InstanceState, WorkerClient, observes_cancellation
from geserve.workers.messages import BatchResult, InstanceSpec, LoadFailed, RunBatch, request_outputs
from geserve.workers.runs import RunId
from geserve.workers.supervisor import ProcessSupervisor, RestartPolicy

__all__ = ["ProcessWorker", "RestartPolicy"]


class ProcessWorker:
    """One instance in a spawned worker process: its batches are written to its arenas and sent on the
    process's channel, where a worker that dies fails its in-flight batches and open streams at once with
    UNAVAILABLE; its ProcessSupervisor restarts it."""

    def __init__(
        self,
        spec: InstanceSpec,
        arena_bytes: int = DEFAULT_ARENA_BYTES,
        restart: RestartPolicy | None = None,
        pipeline_depth: int = 1,
        caller: Callable[[], ModelCaller | None] | None = None,
        *,
        run: RunId | None = None,
    ) -> None:
        # The run whose segments these are (by default this process's).
        run = run or RunId.current()
        self.spec = replace(spec, run=run)
        # Batches the worker may hold at once: one running, the rest waiting in its pipe, each in its
        # own pair of arenas, so the next batch is already there when the running one finishes.
        self.capacity = max(pipeline_depth, 1)
        self.on_ready: Callable[[WorkerClient], None] | None = None
        self.model_ready = True
        self._per_request = observes_cancellation(spec)  # its unary requests learn when their clients go away
        self._arenas = Arenas(self.capacity, arena_bytes, run)
        # The chains of the batches it holds, oldest (the one running) first: a BLS call its model makes is part
        # of the running one's chain, and this instance waits for it.
        self._chains: list[CallChain] = []
        # The model's BLS requests go to the server (`caller`, once it is up).
        bls = BlsServer(caller or (lambda: None), run, self._waiting_chain)
        self._supervisor = ProcessSupervisor(
            self.spec, restart or RestartPolicy(), bls, self._back_up, renew=self._renewed
        )

    @property
    def alive(self) -> bool:
        return self._supervisor.alive

    @property
    def recoverable(self) -> bool:
        return self.state in (InstanceState.READY, InstanceState.RESTARTING)

    @property
    def state(self) -> InstanceState:
        return self._supervisor.state

    @property
    def reason(self) -> str:
        return self._supervisor.reason

    @property
    def incarnation(self) -> int:
        return self._supervisor.incarnation

    @property
    def pid(self) -> int | None:
        return self._supervisor.pid

    @property
    def segments(self) -> list[str]:
        return [*self._arenas.names, self._arenas.output_name]

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> mc.ModelConfig:
        try:
            self._arenas.create()
            self.spec = replace(self.spec, arenas=self._arenas.names, output_arena=self._arenas.output_name)
            result = await self._supervisor.start(self.spec)
        except (GeserveError, OSError) as error:
            await self.stop(timeout_s=5.0)
            message = error.message if isinstance(error, GeserveError) else str(error)
            raise ModelLoadError(f"instance '{self.spec.instance_name}' could not start: {message}") from None
        if isinstance(result, LoadFailed):
            await self.stop(timeout_s=5.0)
            raise ModelLoadError(result.message)
        return mc.ModelConfig.FromString(result.config)

    async def stop(self, timeout_s: float) -> None:
        await self._supervisor.stop(timeout_s)
        self._arenas.unlink()

    def kill(self) -> None:
        """Forced exit: no drain, no waiting."""
        self._supervisor.kill()
        self._arenas.unlink()

    def _renewed(self, spec: InstanceSpec) -> InstanceSpec:
        """The spec of a new process of the instance: an output arena of its own, as the last one's outputs may
        still be read."""
        self.spec = replace(spec, output_arena=self._arenas.renew_output())
        return self.spec

    def _waiting_chain(self) -> CallChain:
        """The chain a BLS call from this instance's model joins: its running batch's, then this instance."""
        if not self._chains:
            return ()  # no batch: a thread the model left running, which holds no instance
        return (*self._chains[0], (self.spec.model_name, self.spec.model_version, self.spec.instance_name))

    def _back_up(self) -> None:
        if self.on_ready is not None:
            self.on_ready(self)

    # -- batches -----------------------------------------------------------------------------

    async def execute(self, batch: Batch) -> BatchResult:
        if not self.alive or not self._arenas.available:
            raise UnavailableError(self._supervisor.exited_message())
        self._chains.append(batch.chain)
        try:
            return await self._execute(batch)
        finally:
            self._chains.remove(batch.chain)

    async def _execute(self, batch: Batch) -> BatchResult:
        slot, inputs = await self._arenas.place(batch.inputs)
        channel = self._supervisor.channel
        if not self.alive or channel is None:
            self._arenas.release(slot)
            raise UnavailableError(self._supervisor.exited_message())
        stream_ids = channel.open_streams(batch.streams)  # request index -> stream id
        infos = list(batch.requests)
        for index, stream_id in stream_ids.items():
            infos[index] = infos[index]._replace(stream_id=stream_id)
        cancellable = batch.cancellable if self._per_request else {}
        for index, cancel_id in channel.watch_cancels(cancellable).items():
            infos[index] = infos[index]._replace(cancel_id=cancel_id)
        failed = set(stream_ids)  # streams the scheduler ends with an error: forgotten here
        try:
            batch_id = channel.new_id()
            placed = await channel.run(RunBatch(batch_id, inputs, batch.output_names, tuple(infos)))
            # The outputs stay in the worker's output arena until every request's reader is done with them.
            lease = Lease(batch_id, channel.release) if placed.blocks else None
            results = request_outputs(placed.blocks, placed.results, lease)
            failed = {index for index in stream_ids if isinstance(results[index], GeserveError)}
            if placed.parameters:
                results = tuple(
                    outcome if isinstance(outcome, GeserveError) else with_parameters(dict(outcome), parameters)
                    for outcome, parameters in zip(results, placed.parameters, strict=True)
                )
            return BatchResult(results, placed.infer_start_ns, placed.infer_end_ns)
        except (OSError, ValueError):
            # The pipe broke (or was closed on EOF) before the exit was reaped: the worker is gone.
            raise UnavailableError(self._supervisor.exited_message()) from None
        finally:
            self._arenas.release(slot)
            channel.forget_streams(stream_ids[index] for index in failed)
            _unwatch(cancellable)

    async def read_status(self) -> InstanceStatus | None:
        """Device usage, the model's readiness and metrics, read by the worker between batches."""
        channel = self._supervisor.channel
        if not self.alive or channel is None:
            return None
        status = await channel.read_status()
        if status is not None:
            self.model_ready = status.ready
        return status


def _unwatch(requests: Mapping[int, Cancellable]) -> None:
    """The batch is back (or never went): a client that goes away now has nothing left to stop."""
    for request in requests.values():
        request.on_cancel(None)
