"""`make bench-npu`: a ResNet-50-shaped `.om` on 1 and 2 simulated NPUs under perf_analyzer, device-bound, with
one server process and with several (`--frontend-processes`), A/B per point."""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tests.fakes.om_models import resnet50_description
from tests.fakes.om_writer import write_om
from tests.perf.bench_server import RESULTS, find_perf_analyzer, run_perf_analyzer
from tests.perf.process_roles import ROLES, RoleCpu
from tests.perf.projection import project_host
from tests.support import ROOT, GeserveProcess, http_status

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


def _counts(server: GeserveProcess) -> tuple[int, int, int]:
    """(images, batches, requests) the model has answered so far."""
    stats = json.loads(_get(f"http://{server.url}/v2/models/resnet50/stats"))["model_stats"][0]
    requests = int(stats["inference_stats"]["success"]["count"])
    return int(stats["inference_count"]), int(stats["execution_count"]), requests


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


def simulator_environment(devices: int) -> dict[str, str]:
    """The pyACL simulator with exactly `devices` NPUs; the server's processes (a supervisor's engine and its
    workers too) inherit it."""
    return {
        "PYTHONPATH": os.pathsep.join([str(FAKES), os.environ.get("PYTHONPATH", "")]),
        "ACL_SIM_DEVICE_COUNT": str(devices),
        "ACL_SIM_EXECUTE_US": str(T0_US),
        "ACL_SIM_EXECUTE_US_PER_ROW": str(K_US),
    }


@functools.cache
def accepts_frontend_processes() -> bool:
    """Whether this checkout's geserve has `--frontend-processes`."""
    command = [sys.executable, "-m", "geserve", "--help"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    return "--frontend-processes" in result.stdout


def frontend_arguments(frontend_processes: int) -> list[str]:
    """The flag, always spelled out where it exists (so GESERVE_TEST_FRONTEND_PROCESSES cannot change the mode)."""
    if accepts_frontend_processes():
        return [f"--frontend-processes={frontend_processes}"]
    if frontend_processes == 1:
        return []  # a geserve from before the flag: one process is all it does
    sys.exit(f"this geserve has no --frontend-processes: measure with --frontend-processes 1, not {frontend_processes}")


def start_server(work: Path, devices: int, frontend_processes: int) -> GeserveProcess:
    """geserve on `devices` simulated NPUs with `frontend_processes` protocol processes, the model loaded."""
    folder = work / f"n{frontend_processes}"
    folder.mkdir(parents=True)
    write_model(folder / "models", devices)
    server = GeserveProcess(
        folder / "geserve.log",
        f"--model-repository={folder / 'models'}",
        f"--device-ids={','.join(str(device) for device in range(devices))}",
        "--allow-client-shm=true",
        "--metrics-interval-ms=250",
        *frontend_arguments(frontend_processes),
        env=simulator_environment(devices),
    ).wait_live()
    deadline = time.monotonic() + 90
    while http_status(f"http://{server.url}/v2/models/resnet50/ready") != 200:
        if time.monotonic() > deadline:
            server.stop()
            raise TimeoutError(f"resnet50 did not become ready:\n{server.log()}")
        time.sleep(0.1)
    return server


def measure(
    tool: str,
    server: GeserveProcess,
    devices: int,
    protocol: str,
    concurrency: int,
    interval: int,
    frontend_processes: int = 1,
) -> dict[str, Any]:
    port = server.http_port if protocol == "http" else server.grpc_port
    extra = ["--shared-memory", "system", "--output-shared-memory-size", "4000"] if protocol == "shm" else []
    cpu = RoleCpu(server.process.pid)
    images_before, batches_before, requests_before = _counts(server)
    cpu.start()
    with BusySampler(server, devices) as sampler:
        figures = run_perf_analyzer(
            tool, "resnet50", "grpc" if protocol == "shm" else protocol, port, concurrency, image_data(RESULTS), interval,
            extra,
        )  # fmt: skip
    seconds = cpu.stop()
    images_after, batches_after, requests_after = _counts(server)
    images, batches = images_after - images_before, batches_after - batches_before
    requests = requests_after - requests_before
    bound = device_bound(devices)
    per_image = {role: round(1000 * seconds[role] / images, 3) if images else 0.0 for role in ROLES}
    engine_us = round(1e6 * seconds["engine"] / requests, 1) if requests and frontend_processes > 1 else None
    return {
        "server": "geserve",
        "frontend_processes": frontend_processes,
        "devices": devices,
        "protocol": protocol,
        "concurrency": concurrency,
        "throughput": round(figures["infer_per_s"], 1),
        "device_bound": bound,
        "busy_pct": round(sampler.busy_pct, 1),
        "p50_ms": round(figures["p50_us"] / 1000, 2),
        "p99_ms": round(figures["p99_us"] / 1000, 2),
        "avg_batch": round(images / batches, 2) if batches else 0.0,
        "host_cpu_ms_per_image": round(1000 * sum(seconds.values()) / images, 3) if images else 0.0,
        "cpu_ms_per_image": per_image,
        "engine_cpu_us_per_request": engine_us,
        "processes": cpu.counts(),
    }


MEDIAN_FIGURES = ("throughput", "busy_pct", "p50_ms", "p99_ms", "avg_batch", "host_cpu_ms_per_image")


def median_of_rounds(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of a point's rounds, figure by figure (CPU role by role); the rounds are kept beside it."""
    merged = dict(records[0])
    for key in MEDIAN_FIGURES:
        merged[key] = round(statistics.median(record[key] for record in records), 2)
    if "cpu_ms_per_image" in merged:
        merged["cpu_ms_per_image"] = {
            role: round(statistics.median(record["cpu_ms_per_image"][role] for record in records), 3)
            for role in merged["cpu_ms_per_image"]
        }
    engine = [record["engine_cpu_us_per_request"] for record in records if record.get("engine_cpu_us_per_request")]
    if engine:
        merged["engine_cpu_us_per_request"] = round(statistics.median(engine), 1)
    merged["rounds"] = [{key: record[key] for key in ("throughput", "p50_ms", "p99_ms")} for record in records]
    return merged


def _point(record: dict[str, Any]) -> tuple[int, str, int]:
    return record["devices"], record["protocol"], record["concurrency"]


Figure = Callable[[dict[str, Any]], str]
SIDE_BY_SIDE: dict[str, Figure] = {
    "÷ device bound": lambda r: f"{r['throughput'] / r['device_bound']:.2f}",
    "device busy %": lambda r: f"{r['busy_pct']:.0f}",
    "p50 ms": lambda r: f"{r['p50_ms']:.1f}",
    "p99 ms": lambda r: f"{r['p99_ms']:.1f}",
    "avg batch": lambda r: f"{r['avg_batch']:.1f}",
    "host CPU ms/image": lambda r: f"{r['host_cpu_ms_per_image']:.2f}",
}


def table(records: list[dict[str, Any]]) -> str:
    """One row per point: each mode's images/s, each against the first mode's, then the other figures of
    every mode in one cell ("a / b", in the order the header names)."""
    geserve = [record for record in records if record["server"] == "geserve"]
    modes = sorted({record["frontend_processes"] for record in geserve})
    by_point: dict[tuple[int, str, int], dict[int, dict[str, Any]]] = {}
    for record in geserve:
        by_point.setdefault(_point(record), {})[record["frontend_processes"]] = record
    names = " / ".join(f"N={mode}" for mode in modes)
    header = ["devices", "protocol", "c", *(f"images/s N={mode}" for mode in modes)]
    header += [f"N={mode}/N={modes[0]}" for mode in modes[1:]]
    header += [f"{column} {names}" for column in SIDE_BY_SIDE]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (devices, protocol, concurrency), point in by_point.items():
        row = [str(devices), protocol, str(concurrency)]
        row += [f"{point[mode]['throughput']:.0f}" if mode in point else "-" for mode in modes]
        row += [_ratio(point, mode, modes[0]) for mode in modes[1:]]
        for figure in SIDE_BY_SIDE.values():
            row.append(" / ".join(figure(point[mode]) if mode in point else "-" for mode in modes))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _ratio(point: dict[int, dict[str, Any]], mode: int, first: int) -> str:
    if mode not in point or first not in point or not point[first]["throughput"]:
        return "-"
    return f"{point[mode]['throughput'] / point[first]['throughput']:.2f}"


def cpu_table(records: list[dict[str, Any]]) -> str:
    """Host CPU ms per image by process role, one row per point and mode."""
    geserve = [record for record in records if record["server"] == "geserve"]
    header = ["devices", "protocol", "c", "N", *ROLES, "total", "engine µs/request"]
    lines = [
        "| " + " | ".join(header[:4] + [f"{role} ms/image" for role in ROLES] + header[-2:]) + " |",
        "|" + "---|" * len(header),
    ]
    for record in sorted(geserve, key=lambda r: (*_point(r), r["frontend_processes"])):
        roles = record["cpu_ms_per_image"]
        engine = record.get("engine_cpu_us_per_request")
        row = [str(value) for value in (*_point(record), record["frontend_processes"])]
        row += [f"{roles[role]:.3f}" if roles[role] else "-" for role in ROLES]
        row += [f"{record['host_cpu_ms_per_image']:.3f}", f"{engine:.0f}" if engine else "-"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def projections(records: list[dict[str, Any]]) -> str:
    """For each mode and protocol, the bigger host projected from its most loaded point (most devices, then
    highest concurrency: the batches as full as this machine makes them)."""
    chosen: dict[tuple[int, str], dict[str, Any]] = {}
    for record in records:
        if record["server"] != "geserve":
            continue
        key = (record["frontend_processes"], record["protocol"])
        if key not in chosen or (record["devices"], record["concurrency"]) > (
            chosen[key]["devices"],
            chosen[key]["concurrency"],
        ):
            chosen[key] = record
    blocks = []
    for (mode, protocol), record in sorted(chosen.items()):
        projection = project_host(record["cpu_ms_per_image"], mode, device_bound(1))
        source = f"from N={mode} {protocol} c={record['concurrency']} on {record['devices']} device(s)"
        blocks.append("\n".join([f"{projection.lines[0]} {source}", *projection.lines[1:]]))
    return "\n\n".join(blocks)


def add_point_arguments(parser: argparse.ArgumentParser) -> None:
    """Which points to measure: devices, protocols, concurrencies, server processes, and perf_analyzer's window."""
    parser.add_argument("--interval-ms", type=int, default=2000, help="perf_analyzer measurement window")
    parser.add_argument("--devices", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--protocols", nargs="*", default=list(PROTOCOLS), choices=PROTOCOLS)
    parser.add_argument("--concurrency", type=int, nargs="*", default=list(CONCURRENCY))
    parser.add_argument(
        "--frontend-processes", type=int, nargs="*", default=[1, 2], help="geserve's modes, each measured per point"
    )
    parser.add_argument("--rounds", type=int, default=2, help="A/B rounds per point; the tables show their median")


def report(records: list[dict[str, Any]]) -> str:
    """The side-by-side table, CPU by role, and the projected host."""
    return "\n\n".join(
        [
            table(records),
            "CPU ms per image by process role (N=1: `server` is protocol and engine in one process)",
            cpu_table(records),
            projections(records),
        ]
    )


def _line(record: dict[str, Any]) -> str:
    return (
        f"N={record['frontend_processes']} {record['devices']} device(s) {record['protocol']:4} "
        f"c={record['concurrency']:<3} {record['throughput']:7.0f} images/s "
        f"({record['throughput'] / record['device_bound']:.2f} of the bound), busy {record['busy_pct']:.0f}%, "
        f"p99 {record['p99_ms']:.1f} ms, host CPU {record['host_cpu_ms_per_image']:.2f} ms/image"
    )


def stop_servers_on_sigterm() -> None:
    """SIGTERM (a `timeout` around the run) unwinds like Ctrl-C, so the `finally` blocks stop the servers."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_point_arguments(parser)
    arguments = parser.parse_args()
    stop_servers_on_sigterm()
    tool = find_perf_analyzer()
    modes = list(dict.fromkeys(arguments.frontend_processes))
    print(
        f"perf_analyzer: {tool}; t(b) = {T0_US / 1000:g} ms + {K_US / 1000:g} ms x b per simulated device; "
        f"--frontend-processes {' and '.join(map(str, modes))}; median of {arguments.rounds} rounds"
    )
    records: list[dict[str, Any]] = []
    for devices in arguments.devices:
        work = Path(tempfile.mkdtemp(prefix="geserve-bench-npu-"))
        servers: dict[int, GeserveProcess] = {}
        try:
            for mode in modes:
                servers[mode] = start_server(work, devices, mode)
            for protocol in arguments.protocols:
                for concurrency in arguments.concurrency:
                    rounds: dict[int, list[dict[str, Any]]] = {mode: [] for mode in modes}
                    for round_index in range(arguments.rounds):
                        # N=1, N=2, then N=2, N=1: neither mode always runs first.
                        for mode in modes if round_index % 2 == 0 else modes[::-1]:
                            point = (devices, protocol, concurrency, arguments.interval_ms, mode)
                            rounds[mode].append(measure(tool, servers[mode], *point))
                    for mode in modes:
                        record = median_of_rounds(rounds[mode])
                        records.append(record)
                        print(_line(record))
        finally:
            for server in servers.values():
                server.stop()
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"npu-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(records, indent=2))
    print(f"\nwrote {path.relative_to(ROOT)}\n")
    print(report(records))


if __name__ == "__main__":
    main()
