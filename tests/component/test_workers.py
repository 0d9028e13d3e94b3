"""Worker clients: process and in-process twins answer alike; a dead worker fails its in-flight requests."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from geserve._generated import model_config_pb2 as mc
from geserve.batching.policy import BatchingPolicy
from geserve.batching.request import ScheduledRequest
from geserve.batching.scheduler import Scheduler
from geserve.core.stats import ModelStats
from geserve.errors import ModelLoadError, UnavailableError
from geserve.repository.config import parse_config_text
from geserve.residency import SharedTensor
from geserve.workers.batch import Batch
from geserve.workers.client import InstanceState, ThreadWorker, WorkerClient
from geserve.workers.messages import InstanceSpec, RequestInfo
from geserve.workers.pool import InstancePool
from geserve.workers.process import ProcessWorker, RestartPolicy
from geserve.workers.runs import RunId
from geserve.workers.shm import SHM_PREFIX
from tests.support import identity_config


async def outputs_of(scheduler: Scheduler, request: ScheduledRequest) -> dict[str, np.ndarray]:
    return {name: tensor.array for name, tensor in (await scheduler.execute(request)).outputs.items()}


def local(array: np.ndarray) -> SharedTensor:
    """An input held in this process (the worker's owner writes it to the slot's input arena)."""
    return SharedTensor.local(array)


def spec(tmp_path: Path, delay_ms: str = "0", backend: str = "identity") -> InstanceSpec:
    config = parse_config_text(identity_config("echo", dims="3", max_batch_size=4, delay_ms=delay_ms), "test")
    return InstanceSpec(
        model_name="echo",
        model_version=1,
        instance_name="echo_0",
        backend=backend,
        config=config.SerializeToString(),
        model_path=str(tmp_path),
        device_id=0,
        auto_complete=True,
        log_level=30,
    )


@pytest.mark.parametrize("kind", [ProcessWorker, ThreadWorker])
async def test_worker_executes_and_stops(tmp_path: Path, kind: type[ProcessWorker] | type[ThreadWorker]) -> None:
    worker: WorkerClient = kind(spec(tmp_path))
    config = await worker.start()
    assert isinstance(config, mc.ModelConfig) and config.name == "echo"
    assert worker.alive
    data = np.arange(6, dtype=np.float32).reshape(2, 3)
    batches = (worker.execute(Batch({"INPUT0": [local(data + i)]}, ("OUTPUT0",), requests(2))) for i in range(5))
    results = await asyncio.gather(*batches)
    for i, executed in enumerate(results):
        (outputs,) = executed.results
        assert isinstance(outputs, dict)
        np.testing.assert_array_equal(outputs["OUTPUT0"].array, data + i)
    await worker.stop(timeout_s=10)
    assert not worker.alive


async def test_workers_stopping_together_are_each_reaped_once_and_never_killed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A worker's pipe closes as it exits, which starts a reaper while stop() waits on the same process.
    # Two waitpid() calls on one child made the loser (ECHILD) report a cleanly exited worker as "did not
    # stop in 30s" and kill it. A reaping that takes a moment longer, as on a busy host, made it certain.
    real_waitpid = os.waitpid

    def slow_waitpid(pid: int, options: int) -> tuple[int, int]:
        result = real_waitpid(pid, options)
        if result[0] == pid:
            time.sleep(0.2)
        return result

    monkeypatch.setattr(os, "waitpid", slow_waitpid)
    for _ in range(3):
        workers = [ProcessWorker(spec(tmp_path)) for _ in range(3)]
        await asyncio.gather(*(worker.start() for worker in workers))
        processes = [worker._supervisor.process for worker in workers]
        await asyncio.gather(*(worker.stop(timeout_s=30) for worker in workers))
        assert not [record.message for record in caplog.records if "did not stop" in record.message]
        assert all(process is not None and process._closed for process in processes)  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", [ProcessWorker, ThreadWorker])
async def test_load_failure_is_reported(tmp_path: Path, kind: type[ProcessWorker] | type[ThreadWorker]) -> None:
    worker: WorkerClient = kind(spec(tmp_path, delay_ms="soon"))
    with pytest.raises(ModelLoadError, match="parameter 'execute_delay_ms' must be a number, got 'soon'"):
        await worker.start()
    worker = kind(spec(tmp_path, backend="nonexistent"))
    with pytest.raises(ModelLoadError, match="unknown backend 'nonexistent'"):
        await worker.start()


def requests(*rows: int) -> list[RequestInfo]:
    return [RequestInfo(count, ("OUTPUT0",)) for count in rows]


def shm_segments() -> set[str]:
    """This process's run's segments (its ProcessWorkers' names carry it), whatever else runs on the machine."""
    return {entry.name for entry in Path("/dev/shm").iterdir() if entry.name.startswith(RunId.current().prefix)}


async def wait_for_state(worker: ProcessWorker, state: InstanceState, timeout_s: float = 15.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if worker.state is state:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"instance stayed {worker.state}, expected {state}")


async def test_killed_worker_fails_in_flight_requests_at_once_and_restarts(tmp_path: Path) -> None:
    worker = ProcessWorker(spec(tmp_path, delay_ms="1500"), restart=RestartPolicy(first_delay_s=0.1), pipeline_depth=2)
    await worker.start()
    scheduler = Scheduler("echo", InstancePool([worker]), BatchingPolicy(max_batch_size=4), ModelStats())
    first_pid = worker.pid
    assert first_pid is not None
    data = np.ones((1, 3), dtype=np.float32)
    # The worker holds two batches (one running, one behind it); the third waits in the scheduler.
    in_flight = [
        asyncio.ensure_future(outputs_of(scheduler, ScheduledRequest({"INPUT0": local(data)}, ("OUTPUT0",))))
        for _ in range(2)
    ]
    queued = asyncio.ensure_future(outputs_of(scheduler, ScheduledRequest({"INPUT0": local(data * 2)}, ("OUTPUT0",))))
    await asyncio.sleep(0.3)
    os.kill(first_pid, signal.SIGKILL)
    for task in in_flight:
        with pytest.raises(UnavailableError, match=r"instance 'echo_0' of model 'echo' version 1 exited unexpectedly"):
            await asyncio.wait_for(task, 1.0)  # at once, not after the 1.5 s execution
    # The queued request waits for the restarted instance instead of failing.
    outputs = await asyncio.wait_for(queued, 20)
    np.testing.assert_array_equal(outputs["OUTPUT0"], data * 2)
    assert worker.alive and worker.pid not in (None, first_pid)
    await worker.stop(timeout_s=5)


async def test_a_worker_whose_pipe_ended_takes_no_batch_and_says_it_exited(tmp_path: Path) -> None:
    worker = ProcessWorker(spec(tmp_path), restart=RestartPolicy(first_delay_s=0.5))
    await worker.start()
    assert worker.pid is not None
    os.kill(worker.pid, signal.SIGKILL)
    while worker.alive:  # noqa: ASYNC110  (until the loop has seen the pipe end)
        await asyncio.sleep(0.001)
    # Between the pipe's end and the exit being reaped the state still read "ready": a batch sent then
    # failed with "instance ... is ready: [Errno 32] Broken pipe".
    with pytest.raises(UnavailableError) as error:
        await worker.execute(Batch({"INPUT0": [local(np.ones((1, 3), np.float32))]}, ("OUTPUT0",), requests(1)))
    assert "echo_0' of model 'echo' version 1 exited unexpectedly" in error.value.message
    assert "is ready" not in error.value.message and "Errno" not in error.value.message
    await wait_for_state(worker, InstanceState.READY)
    await worker.stop(timeout_s=5)


async def test_crash_loop_gives_up_with_the_reason(tmp_path: Path) -> None:
    worker = ProcessWorker(spec(tmp_path), restart=RestartPolicy(first_delay_s=0.05, max_crashes=2))
    await worker.start()
    scheduler = Scheduler("echo", InstancePool([worker]), BatchingPolicy(max_batch_size=4), ModelStats())
    for _ in range(2):
        await wait_for_state(worker, InstanceState.READY)
        assert worker.pid is not None
        os.kill(worker.pid, signal.SIGKILL)
        await asyncio.sleep(0.3)
    await wait_for_state(worker, InstanceState.FAILED)
    assert "crashed 2 times" in worker.reason
    with pytest.raises(UnavailableError, match="model 'echo' has no running instance"):
        await outputs_of(scheduler, ScheduledRequest({"INPUT0": local(np.ones((1, 3), np.float32))}, ("OUTPUT0",)))
    await worker.stop(timeout_s=5)


async def test_shared_memory_is_released(tmp_path: Path) -> None:
    before = shm_segments()
    worker = ProcessWorker(spec(tmp_path), arena_bytes=4096, pipeline_depth=2)
    await worker.start()
    # An input arena for each of the two batches it may hold, and the output arena the worker leaves outputs in.
    arenas = shm_segments() - before
    assert len(arenas) == 3 and arenas == set(worker.segments)
    assert all(name.startswith(SHM_PREFIX) for name in worker.segments)
    big = np.arange(3 * 4000, dtype=np.float32).reshape(-1, 3)  # 48 kB: too large for the 4 and 8 kB arenas
    parts = [local(big[:1000]), local(big[1000:])]
    executed = await worker.execute(Batch({"INPUT0": parts}, ("OUTPUT0",), requests(1000, 3000)))
    first, second = executed.results
    assert isinstance(first, dict) and isinstance(second, dict)
    np.testing.assert_array_equal(np.concatenate([first["OUTPUT0"].array, second["OUTPUT0"].array]), big)
    # The inputs' one-off segment is gone with the batch; the outputs' one stays while they are read...
    assert len(shm_segments() - before - arenas) == 1
    del executed, first, second
    gc.collect()
    # ... and goes once they are released.
    for _ in range(300):
        if shm_segments() - before == arenas:
            break
        await asyncio.sleep(0.05)
    assert shm_segments() - before == arenas
    await worker.stop(timeout_s=5)
    assert shm_segments() == before
    failing = ProcessWorker(spec(tmp_path, backend="nonexistent"))
    with pytest.raises(ModelLoadError):
        await failing.start()
    assert shm_segments() == before


async def test_scheduler_skips_dead_instances(tmp_path: Path) -> None:
    first, second = ProcessWorker(spec(tmp_path)), ProcessWorker(spec(tmp_path))
    await asyncio.gather(first.start(), second.start())
    scheduler = Scheduler("echo", InstancePool([first, second]), BatchingPolicy(max_batch_size=4), ModelStats())
    assert first.pid is not None
    os.kill(first.pid, signal.SIGKILL)
    # Waits for the death to be noticed however loaded the machine is (a busy CI host can take seconds).
    for _ in range(600):
        if not first.alive:
            break
        await asyncio.sleep(0.1)
    assert not first.alive
    data = np.ones((1, 3), dtype=np.float32)
    for _ in range(4):
        outputs = await outputs_of(scheduler, ScheduledRequest({"INPUT0": local(data)}, ("OUTPUT0",)))
        np.testing.assert_array_equal(outputs["OUTPUT0"], data)
    await asyncio.gather(first.stop(5), second.stop(5))
