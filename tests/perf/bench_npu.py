"""`make bench-npu`: a ResNet-50-shaped `.om` on 1 and 2 simulated NPUs under perf_analyzer, device-bound."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from tests.fakes.om_models import resnet50_description
from tests.fakes.om_writer import write_om
from tests.perf.bench_server import RESULTS, _children, _process_usage, find_perf_analyzer, run_perf_analyzer
from tests.support import ROOT, GeserveProcess

FAKES = ROOT / "tests" / "fakes"
GEARS = [1, 2, 4, 8, 16]
T0_US, K_US = 2000, 500  # t(b) = 2 ms + 0.5 ms per image: 1,600 images/s per device at batch 16
CONCURRENCY = (1, 16, 64, 100)
PROTOCOLS = ("http", "grpc", "shm")
CONFIG = """
name: "resnet50"
backend: "ge"
max_batch_size: 16
input [ {{ name: "input" data_type: TYPE_FP32 dims: [ 3, 224, 224 ] }} ]
output [ {{ name: "output" data_type: TYPE_FP32 dims: [ 1000 ] }} ]
instance_group [ {{ kind: KIND_GPU count: 1 gpus: [ {gpus} ] }} ]
dynamic_batching {{ preferred_batch_size: [ 16 ] max_queue_delay_microseconds: 2000 }}
"""


def device_bound(devices: int) -> float:
    """Images/s the simulated devices can do at their best gear."""
    best = max(GEARS)
    return devices * best / ((T0_US + K_US * best) / 1e6)


def write_model(repository: Path, devices: int) -> None:
    """The `.om` as ATC describes a ResNet-50 with batch gears (no twin: the simulator fills the outputs)."""
    write_om(repository / "resnet50" / "1" / "model.om", resnet50_description(GEARS))
    gpus = ", ".join(str(device) for device in range(devices))
    (repository / "resnet50" / "config.pbtxt").write_text(CONFIG.format(gpus=gpus))


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode())


def _counts(server: GeserveProcess) -> tuple[int, int]:
    stats = json.loads(_get(f"http://{server.url}/v2/models/resnet50/stats"))["model_stats"][0]
    return int(stats["inference_count"]), int(stats["execution_count"])


class BusySampler:
    """Samples nv_gpu_utilization of the used devices while a measurement runs."""

    def __init__(self, server: GeserveProcess, devices: int) -> None:
        self._url = f"http://127.0.0.1:{server.metrics_port}/metrics"
        self._labels = [f'gpu_uuid="NPU-{device}"' for device in range(devices)]
        self._samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> BusySampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            readings = [
                float(line.rsplit(" ", 1)[1])
                for line in _get(self._url).splitlines()
                if line.startswith("nv_gpu_utilization{") and any(label in line for label in self._labels)
            ]
            if readings:
                self._samples.append(sum(readings) / len(self._labels))

    @property
    def busy_pct(self) -> float:
        # The first readings cover the time before the load started.
        kept = self._samples[2:] or self._samples
        return 100 * sum(kept) / len(kept) if kept else 0.0


def image_data(folder: Path) -> Path:
    """One 3x224x224 image of normal values, as perf_analyzer input data: the same bytes for every server
    and protocol (perf_analyzer's own random JSON values are refused by MLServer)."""
    path = folder / "image.json"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        image = np.random.default_rng(0).standard_normal(3 * 224 * 224).astype(np.float32)
        path.write_text(json.dumps({"data": [{"input": [round(float(value), 4) for value in image]}]}))
    return path


def measure(
    tool: str, server: GeserveProcess, devices: int, protocol: str, concurrency: int, interval: int
) -> dict[str, Any]:
    port = server.http_port if protocol == "http" else server.grpc_port
    extra = ["--shared-memory", "system", "--output-shared-memory-size", "4000"] if protocol == "shm" else []
    pids = [server.process.pid, *_children(server.process.pid)]
    cpu_before = sum(_process_usage(pid)[1] for pid in pids)
    images_before, batches_before = _counts(server)
    with BusySampler(server, devices) as sampler:
        figures = run_perf_analyzer(
            tool, "resnet50", "grpc" if protocol == "shm" else protocol, port, concurrency, image_data(RESULTS), interval,
            extra,
        )  # fmt: skip
    cpu = sum(_process_usage(pid)[1] for pid in pids if Path(f"/proc/{pid}").exists()) - cpu_before
    images_after, batches_after = _counts(server)
    images, batches = images_after - images_before, batches_after - batches_before
    bound = device_bound(devices)
    return {
        "server": "geserve",
        "devices": devices,
        "protocol": protocol,
        "concurrency": concurrency,
        "throughput": round(figures["infer_per_s"], 1),
        "device_bound": bound,
        "busy_pct": round(sampler.busy_pct, 1),
        "p50_ms": round(figures["p50_us"] / 1000, 2),
        "p99_ms": round(figures["p99_us"] / 1000, 2),
        "avg_batch": round(images / batches, 2) if batches else 0.0,
        "host_cpu_ms_per_image": round(1000 * cpu / images, 3) if images else 0.0,
    }


def table(records: list[dict[str, Any]]) -> str:
    lines = [
        "| devices | protocol | c | images/s | ÷ device bound | device busy % | p50 ms | p99 ms | avg batch | host CPU ms/image |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {r['devices']} | {r['protocol']} | {r['concurrency']} | {r['throughput']:.0f} | "
            f"{r['throughput'] / r['device_bound']:.2f} | {r['busy_pct']:.0f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
            f"{r['avg_batch']:.1f} | {r['host_cpu_ms_per_image']:.2f} |"
        )
    return "\n".join(lines)


def add_point_arguments(parser: argparse.ArgumentParser) -> None:
    """Which points to measure: devices, protocols, concurrencies, and perf_analyzer's window."""
    parser.add_argument("--interval-ms", type=int, default=2000, help="perf_analyzer measurement window")
    parser.add_argument("--devices", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--protocols", nargs="*", default=list(PROTOCOLS), choices=PROTOCOLS)
    parser.add_argument("--concurrency", type=int, nargs="*", default=list(CONCURRENCY))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_point_arguments(parser)
    arguments = parser.parse_args()
    tool = find_perf_analyzer()
    print(f"perf_analyzer: {tool}; t(b) = {T0_US / 1000:g} ms + {K_US / 1000:g} ms x b per simulated device")
    records: list[dict[str, Any]] = []
    for devices in arguments.devices:
        work = Path(tempfile.mkdtemp(prefix="geserve-bench-npu-"))
        write_model(work / "models", devices)
        environment = {
            "PYTHONPATH": os.pathsep.join([str(FAKES), os.environ.get("PYTHONPATH", "")]),
            "ACL_SIM_DEVICE_COUNT": "2",
            "ACL_SIM_EXECUTE_US": str(T0_US),
            "ACL_SIM_EXECUTE_US_PER_ROW": str(K_US),
        }
        server = GeserveProcess(
            work / "geserve.log",
            f"--model-repository={work / 'models'}",
            "--device-ids=0,1",
            "--allow-client-shm=true",
            "--metrics-interval-ms=250",
            env=environment,
        ).wait_live()
        try:
            for protocol in arguments.protocols:
                for concurrency in arguments.concurrency:
                    record = measure(tool, server, devices, protocol, concurrency, arguments.interval_ms)
                    records.append(record)
                    print(
                        f"{devices} device(s) {protocol:4} c={concurrency:<3} {record['throughput']:7.0f} images/s "
                        f"({record['throughput'] / record['device_bound']:.2f} of the bound), busy "
                        f"{record['busy_pct']:.0f}%, p99 {record['p99_ms']:.1f} ms"
                    )
        finally:
            server.stop()
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"npu-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(records, indent=2))
    print(f"\nwrote {path.relative_to(ROOT)}\n")
    print(table(records))


if __name__ == "__main__":
    main()
