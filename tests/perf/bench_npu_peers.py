"""`make bench-npu-peers`: the NPU-bound workload on geserve (each `--frontend-processes` mode), Triton (python
backend) and MLServer, A/B per point."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.perf import bench_npu
from tests.perf.bench_npu import (
    K_US,
    T0_US,
    add_point_arguments,
    device_bound,
    image_data,
    median_of_rounds,
    report,
    start_server,
    stop_servers_on_sigterm,
)
from tests.perf.bench_peers import (
    CACHE,
    PEERS,
    MLServerProcess,
    ensure_mlserver,
    ensure_venv,
    stop_process,
    wait_ready,
)
from tests.perf.bench_server import RESULTS, find_perf_analyzer, run_perf_analyzer
from tests.perf.process_roles import ROLES, RoleCpu
from tests.support import ROOT, GeserveProcess, free_ports

TRITON_VENV = CACHE / "triton-venv"
TRITON_REQUIREMENTS = ["nvidia-pytriton==0.7.0"]  # its wheel carries tritonserver and the python backend
SERVERS = ("geserve", "triton", "mlserver")
MAX_BATCH, DELAY_US = 16, 2000  # the same batching everywhere: geserve's and Triton's dynamic, MLServer's adaptive
TRITON_CONFIG = """
name: "resnet50"
backend: "python"
max_batch_size: {max_batch}
input [ {{ name: "input" data_type: TYPE_FP32 dims: [ 3, 224, 224 ] }} ]
output [ {{ name: "output" data_type: TYPE_FP32 dims: [ 1000 ] }} ]
instance_group [ {{ kind: KIND_CPU count: {devices} }} ]
dynamic_batching {{ preferred_batch_size: [ {max_batch} ] max_queue_delay_microseconds: {delay_us} }}
parameters [
  {{ key: "t0_us" value {{ string_value: "{t0}" }} }},
  {{ key: "k_us" value {{ string_value: "{k}" }} }},
  {{ key: "batch_log" value {{ string_value: "{log}" }} }}
]
"""


def ensure_triton() -> Path:
    return ensure_venv(TRITON_VENV, TRITON_REQUIREMENTS, "PyTriton (tritonserver)")


class TritonProcess:
    """PyTriton's bundled tritonserver with its python backend, run directly on a model repository."""

    def __init__(self, venv: Path, folder: Path, log: Path) -> None:
        packages = next((venv / "lib").glob("python3*/site-packages"))
        bundled = packages / "pytriton" / "tritonserver"
        python_version = packages.parent.name.removeprefix("python")
        backend = folder / "backends" / "python"
        backend.mkdir(parents=True)
        for source in ("libtriton_python.so", "triton_python_backend_utils.py"):
            shutil.copy(bundled / "backends" / "python" / source, backend / source)
        # PyTriton puts the stub for the running Python beside the backend, as it does here.
        shutil.copy(bundled / "python_backend_stubs" / python_version / "triton_python_backend_stub", backend)
        self.http_port, self.grpc_port, metrics_port = free_ports(3)
        environment = {
            **os.environ,
            "LD_LIBRARY_PATH": str(packages / "nvidia_pytriton.libs"),
            # The stub's embedded Python finds the venv (numpy) through the first python3 on PATH.
            "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}",
        }
        self._log = log.open("wb")
        self._segments_before = set(_triton_segments())
        self.process = subprocess.Popen(
            [
                str(bundled / "bin" / "tritonserver"), f"--model-repository={folder / 'models'}",
                f"--backend-directory={folder / 'backends'}", f"--http-port={self.http_port}",
                f"--grpc-port={self.grpc_port}", f"--metrics-port={metrics_port}", "--http-address=127.0.0.1",
                "--grpc-address=127.0.0.1", "--log-verbose=0",
                # Room for a whole batch of images in the python backend's shared memory from the start: with
                # the 1 MiB default, growing it under load crashed tritonserver (boost lock_exception).
                "--backend-config=python,shm-default-byte-size=67108864",
                "--backend-config=python,shm-growth-byte-size=16777216",
            ],
            stdout=self._log, stderr=subprocess.STDOUT, env=environment,
        )  # fmt: skip
        wait_ready("tritonserver", self.process, self.http_port, log, 120)

    def stop(self) -> None:
        stop_process(self.process)
        self._log.close()
        # A tritonserver that crashed leaves its python backend's segments behind (tens of MiB each).
        for path in _triton_segments():
            if path not in self._segments_before:
                path.unlink(missing_ok=True)


def _triton_segments() -> list[Path]:
    return list(Path("/dev/shm").glob("triton_python_backend_shm_region_*"))


def triton_repository(folder: Path, devices: int, batch_log: Path) -> None:
    model = folder / "models" / "resnet50"
    (model / "1").mkdir(parents=True)
    shutil.copy(PEERS / "sleeping_triton.py", model / "1" / "model.py")
    (model / "config.pbtxt").write_text(
        TRITON_CONFIG.format(max_batch=MAX_BATCH, devices=devices, delay_us=DELAY_US, t0=T0_US, k=K_US, log=batch_log)
    )


def mlserver_repository(folder: Path, batch_log: Path) -> None:
    model = folder / "resnet50"
    model.mkdir(parents=True)
    shutil.copy(PEERS / "sleeping_mlserver.py", folder / "sleeping_mlserver.py")
    inputs = [{"name": "input", "datatype": "FP32", "shape": [-1, 3, 224, 224]}]
    outputs = [{"name": "output", "datatype": "FP32", "shape": [-1, 1000]}]
    settings = {
        "name": "resnet50",
        "implementation": "sleeping_mlserver.SleepingModel",
        "max_batch_size": MAX_BATCH,
        "max_batch_time": DELAY_US / 1e6,
        "parameters": {"extra": {"t0_us": T0_US, "k_us": K_US, "batch_log": str(batch_log)}},
        "inputs": inputs,
        "outputs": outputs,
    }
    (model / "model-settings.json").write_text(json.dumps(settings))
    config = {
        "name": "resnet50",
        "platform": "python",
        "max_batch_size": MAX_BATCH,
        "input": [{"name": "input", "datatype": "FP32", "dims": [3, 224, 224]}],
        "output": [{"name": "output", "datatype": "FP32", "dims": [1000]}],
    }
    (model / "config.json").write_text(json.dumps(config))


@dataclass
class Peer:
    """A peer server under test: its ports, its processes, and the log its model appends each batch's size to."""

    name: str
    http_port: int
    grpc_port: int
    pid: int
    batch_log: Path
    shared_memory: bool

    def batches(self) -> list[int]:
        text = self.batch_log.read_text() if self.batch_log.exists() else ""
        return [int(line) for line in text.split()]


def measure_peer(tool: str, peer: Peer, devices: int, protocol: str, concurrency: int, interval: int) -> dict[str, Any]:
    port = peer.http_port if protocol == "http" else peer.grpc_port
    extra = ["--shared-memory", "system", "--output-shared-memory-size", "4000"] if protocol == "shm" else []
    if peer.name == "mlserver" and protocol == "http":
        extra += ["--input-tensor-format", "json", "--output-tensor-format", "json"]  # no binary tensor extension
    cpu = RoleCpu(peer.pid)  # the top process is the `server`, everything below it a `worker`
    seen = len(peer.batches())
    cpu.start()
    started = time.monotonic()
    figures = run_perf_analyzer(
        tool,
        "resnet50",
        "grpc" if protocol == "shm" else protocol,
        port,
        concurrency,
        image_data(RESULTS),
        interval,
        extra,
    )
    elapsed = time.monotonic() - started
    seconds = cpu.stop()
    batches = peer.batches()[seen:]
    images = sum(batches)
    device_s = sum(T0_US + K_US * batch for batch in batches) / 1e6 / devices  # the sleeps stand for the device
    return {
        "server": peer.name,
        "frontend_processes": None,
        "devices": devices,
        "protocol": protocol,
        "concurrency": concurrency,
        "throughput": round(figures["infer_per_s"], 1),
        "device_bound": device_bound(devices),
        "busy_pct": round(100 * device_s / elapsed, 1),
        "p50_ms": round(figures["p50_us"] / 1000, 2),
        "p99_ms": round(figures["p99_us"] / 1000, 2),
        "avg_batch": round(images / len(batches), 2) if batches else 0.0,
        "host_cpu_ms_per_image": round(1000 * sum(seconds.values()) / images, 3) if images else 0.0,
        "cpu_ms_per_image": {role: round(1000 * seconds[role] / images, 3) if images else 0.0 for role in ROLES},
        "engine_cpu_us_per_request": None,
    }


def run_devices(
    tool: str, devices: int, arguments: argparse.Namespace, mlserver: Path, triton: Path
) -> list[dict[str, Any]]:
    work = Path(tempfile.mkdtemp(prefix="geserve-npu-peers-"))
    modes = list(dict.fromkeys(arguments.frontend_processes))
    started: list[Any] = []
    try:
        geserve: dict[str, tuple[GeserveProcess, int]] = {}
        for mode in modes:
            server = start_server(work / "geserve", devices, mode)
            started.append(server)
            geserve[f"geserve N={mode}"] = (server, mode)
        peers: dict[str, Peer] = {}
        if "triton" in arguments.servers:
            triton_repository(work / "triton", devices, work / "triton-batches.log")
            process = TritonProcess(triton, work / "triton", work / "triton.log")
            started.append(process)
            peers["triton"] = Peer("triton", process.http_port, process.grpc_port, process.process.pid,
                                   work / "triton-batches.log", shared_memory=True)  # fmt: skip
        if "mlserver" in arguments.servers:
            mlserver_repository(work / "mlserver", work / "mlserver-batches.log")
            peer_process = MLServerProcess(mlserver, work / "mlserver", work / "mlserver.log", workers=devices)
            started.append(peer_process)
            peers["mlserver"] = Peer("mlserver", peer_process.http_port, peer_process.grpc_port,
                                     peer_process.process.pid, work / "mlserver-batches.log", shared_memory=False)  # fmt: skip
        records: list[dict[str, Any]] = []
        for protocol in arguments.protocols:
            for concurrency in arguments.concurrency:
                rounds: dict[str, list[dict[str, Any]]] = {}
                for round_index in range(arguments.rounds):
                    order = [*geserve, *(s for s in SERVERS if s in peers)]
                    if round_index % 2:
                        order.reverse()  # A/B/C, then C/B/A: neither server always runs first
                    for name in order:
                        if name in peers and protocol == "shm" and not peers[name].shared_memory:
                            continue
                        try:
                            if name in geserve:
                                server, mode = geserve[name]
                                point = (devices, protocol, concurrency, arguments.interval_ms, mode)
                                record = bench_npu.measure(tool, server, *point)
                            else:
                                record = measure_peer(tool, peers[name], devices, protocol, concurrency,
                                                      arguments.interval_ms)  # fmt: skip
                        except RuntimeError as error:
                            print(f"{name} {protocol} c={concurrency}: {str(error)[-300:]}")
                            continue
                        rounds.setdefault(name, []).append(record)
                for measured in rounds.values():
                    record = median_of_rounds(measured)
                    records.append(record)
                    print(_line(record))
        return records
    finally:
        for process in reversed(started):
            process.stop()


def _line(r: dict[str, Any]) -> str:
    server = r["server"] if r["frontend_processes"] is None else f"{r['server']} N={r['frontend_processes']}"
    return (
        f"| {server} | {r['devices']} | {r['protocol']} | {r['concurrency']} | {r['throughput']:.0f} | "
        f"{r['throughput'] / r['device_bound']:.2f} | {r['busy_pct']:.0f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
        f"{r['avg_batch']:.1f} | {r['host_cpu_ms_per_image']:.2f} |"
    )


HEADER = (
    "| server | devices | protocol | c | images/s | ÷ device bound | device busy % | p50 ms | p99 ms | avg batch | "
    "host CPU ms/image |\n|---|---|---|---|---|---|---|---|---|---|---|"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_point_arguments(parser)
    parser.add_argument("--servers", nargs="*", default=list(SERVERS[1:]), choices=SERVERS[1:], help="peers")
    arguments = parser.parse_args()
    stop_servers_on_sigterm()
    tool = find_perf_analyzer()
    mlserver = ensure_mlserver() if "mlserver" in arguments.servers else Path()
    triton = ensure_triton() if "triton" in arguments.servers else Path()
    print(f"perf_analyzer: {tool}; t(b) = {T0_US / 1000:g} ms + {K_US / 1000:g} ms x b per device; "
          f"batches up to {MAX_BATCH}, {DELAY_US} us delay; median of {arguments.rounds} rounds\n{HEADER}")  # fmt: skip
    records: list[dict[str, Any]] = []
    for devices in arguments.devices:
        records += run_devices(tool, devices, arguments, mlserver, triton)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"npu-peers-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(records, indent=2))
    print(f"\nwrote {path.relative_to(ROOT)}\n\n{HEADER}")
    for record in records:
        print(_line(record))
    print(f"\ngeserve, --frontend-processes side by side\n\n{report(records)}")


if __name__ == "__main__":
    main()
