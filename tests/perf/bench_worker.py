"""Worker transport benchmark: one batch's round trip through a worker process vs in-process, and
large-tensor throughput through shared memory vs a plain memcpy. Ratios, measured in one run."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

import numpy as np

from geserve.repository.config import parse_config_text
from geserve.workers.batch import Batch
from geserve.workers.client import ThreadWorker, WorkerClient
from geserve.workers.messages import InstanceSpec, RequestInfo
from geserve.workers.process import ProcessWorker

CONFIG = """
name: "echo"
backend: "identity"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""


ONE_REQUEST = (RequestInfo(1, ("OUTPUT0",)),)


def _spec(folder: str) -> InstanceSpec:
    config = parse_config_text(CONFIG, "bench")
    return InstanceSpec("echo", 1, "echo_0", "identity", config.SerializeToString(), folder, 0, False, 30)


async def _round_trip_us(worker: WorkerClient, elements: int, repeats: int) -> float:
    data = np.ones(elements, dtype=np.float32)
    for _ in range(50):
        await worker.execute(Batch({"INPUT0": [data]}, ("OUTPUT0",), ONE_REQUEST))
    samples = []
    for _ in range(repeats):
        started = time.perf_counter_ns()
        await worker.execute(Batch({"INPUT0": [data]}, ("OUTPUT0",), ONE_REQUEST))
        samples.append(time.perf_counter_ns() - started)
    return statistics.median(samples) / 1000


async def _throughput_gbs(worker: WorkerClient, nbytes: int, repeats: int) -> float:
    data = np.random.default_rng(0).standard_normal(nbytes // 4, dtype=np.float32)
    for _ in range(3):  # first touches map the arenas' pages in both processes
        await worker.execute(Batch({"INPUT0": [data]}, ("OUTPUT0",), ONE_REQUEST))
    started = time.perf_counter()
    for _ in range(repeats):
        executed = await worker.execute(Batch({"INPUT0": [data]}, ("OUTPUT0",), ONE_REQUEST))
    elapsed = time.perf_counter() - started
    (outputs,) = executed.results
    assert isinstance(outputs, dict) and outputs["OUTPUT0"].tobytes() == data.tobytes()
    return 2 * nbytes * repeats / elapsed / 1e9  # bytes in and out


def _memcpy_gbs(nbytes: int, repeats: int) -> float:
    source = np.random.default_rng(0).standard_normal(nbytes // 4, dtype=np.float32)
    target = np.empty_like(source)
    np.copyto(target, source)
    started = time.perf_counter()
    for _ in range(repeats):
        np.copyto(target, source)
    return nbytes * repeats / (time.perf_counter() - started) / 1e9


async def main(repeats: int, large_mib: int) -> None:
    nbytes = large_mib << 20
    with tempfile.TemporaryDirectory() as folder:
        in_process: WorkerClient = ThreadWorker(_spec(folder))
        process = ProcessWorker(_spec(folder), arena_bytes=nbytes + (1 << 20))
        await in_process.start()
        await process.start()
        try:
            for elements in (16, 16 * 1024):
                local = await _round_trip_us(in_process, elements, repeats)
                remote = await _round_trip_us(process, elements, repeats)
                print(
                    f"round trip, {elements * 4} B in and out: in-process {local:.0f} us, worker process "
                    f"{remote:.0f} us -> the process boundary adds {remote - local:.0f} us ({remote / local:.1f}x)"
                )
            through_worker = await _throughput_gbs(process, nbytes, 5)
            memcpy = _memcpy_gbs(nbytes, 5)
            print(
                f"{large_mib} MiB FP32 in and out through a worker: {through_worker:.2f} GB/s; plain memcpy of "
                f"{large_mib} MiB: {memcpy:.2f} GB/s -> {through_worker / memcpy:.2f}x memcpy"
            )
        finally:
            await process.stop(10)
            await in_process.stop(10)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--large-mib", type=int, default=64)
    arguments = parser.parse_args()
    try:  # the server runs on uvloop; measure on the same loop
        import uvloop

        uvloop.run(main(arguments.repeats, arguments.large_mib))
    except ImportError:
        asyncio.run(main(arguments.repeats, arguments.large_mib))
