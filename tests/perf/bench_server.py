"""`make bench`: bare onnxruntime vs geserve under perf_analyzer (HTTP and gRPC), in one run."""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import onnxruntime as ort

from tests.perf import models
from tests.support import ROOT, GeserveProcess, free_ports, http_status

RESULTS = ROOT / "bench-results"
CONCURRENCY = (1, 4, 16)
BATCHES = (1, 8, 16, 32)


def find_perf_analyzer() -> str:
    """$PERF_ANALYZER, else a working perf_analyzer on PATH, else the shared script."""
    candidates = [
        os.environ.get("PERF_ANALYZER"),
        shutil.which("perf_analyzer"),
        str(ROOT.parent / "shared" / "tools" / "perf_analyzer"),
    ]
    for candidate in candidates:
        if candidate and Path(candidate).exists():
            probe = subprocess.run([candidate, "--version"], capture_output=True, text=True, timeout=600, check=False)
            if probe.returncode == 0 and "Perf Analyzer" in probe.stdout + probe.stderr:
                return candidate
    sys.exit("no working perf_analyzer: set PERF_ANALYZER (the PyPI wheel needs glibc >= 2.38)")


def bare_onnxruntime(
    folder: Path, inputs: dict[str, dict[str, tuple[str, list[int]]]], seconds: float
) -> dict[str, dict[int, float]]:
    """Samples/s of each model in-process, with the backend's session settings."""
    results: dict[str, dict[int, float]] = {}
    for name, tensors in inputs.items():
        options = ort.SessionOptions()
        for key in ("session.intra_op.allow_spinning", "session.inter_op.allow_spinning"):
            options.add_session_config_entry(key, "0")  # as geserve's onnxruntime backend does by default
        model_file = str(folder / name / "1" / "model.onnx")
        session = ort.InferenceSession(model_file, sess_options=options, providers=["CPUExecutionProvider"])
        results[name] = {}
        for batch in BATCHES:
            feeds = {tensor: models.sample(datatype, dims, batch) for tensor, (datatype, dims) in tensors.items()}
            session.run(None, feeds)
            runs, started = 0, time.perf_counter()
            while time.perf_counter() - started < seconds:
                session.run(None, feeds)
                runs += 1
            results[name][batch] = runs * batch / (time.perf_counter() - started)
    return results


def _process_usage(pid: int) -> tuple[int, float]:
    """(RSS bytes, CPU seconds) of one process."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss = next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:"))
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return rss, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    """Child processes of every thread (workers are started from a helper thread)."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children += [int(child) for child in (task / "children").read_text().split()]
        except OSError:
            continue
    return children


def run_perf_analyzer(
    tool: str,
    model: str,
    protocol: str,
    port: int,
    concurrency: int,
    input_file: Path,
    interval_ms: int,
    extra: list[str] | None = None,
) -> dict[str, float]:
    with tempfile.NamedTemporaryFile(suffix=".csv") as report:
        command = [
            tool, "-m", model, "-i", protocol, "-u", f"127.0.0.1:{port}", "--input-data", str(input_file),
            "--concurrency-range", str(concurrency), "--measurement-interval", str(interval_ms),
            "--max-trials", "10", "--stability-percentage", "25", "-f", report.name, *(extra or []),
        ]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"perf_analyzer failed (exit {result.returncode}):\n{result.stdout}\n{result.stderr}")
        row = next(csv.DictReader(io.StringIO(Path(report.name).read_text())))
    return {
        "infer_per_s": float(row["Inferences/Second"]),
        "p50_us": float(row["p50 latency"]),
        "p99_us": float(row["p99 latency"]),
        # Servers without the statistics extension (MLServer) have no server-side columns.
        "queue_us": float(row.get("Server Queue") or 0),
        "compute_us": sum(float(row.get(key) or 0) for key in _COMPUTE_COLUMNS),
    }


_COMPUTE_COLUMNS = ("Server Compute Input", "Server Compute Infer", "Server Compute Output")


def input_data(folder: Path, inputs: dict[str, tuple[str, list[int]]]) -> Path:
    folder.mkdir(exist_ok=True)
    data = {name: models.sample(datatype, dims, 1)[0].tolist() for name, (datatype, dims) in inputs.items()}
    path = folder / "input.json"
    path.write_text(json.dumps({"data": [data]}))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--interval-ms", type=int, default=2000, help="perf_analyzer measurement window")
    parser.add_argument("--models", nargs="*", default=["identity", "simple", "mlp"])
    arguments = parser.parse_args()
    tool = find_perf_analyzer()
    print(f"perf_analyzer: {tool}")
    work = Path(tempfile.mkdtemp(prefix="geserve-bench-"))
    repository = work / "models"
    everything = models.build(repository)
    inputs = {name: value for name, value in everything.items() if name in arguments.models}
    for name in set(everything) - set(inputs):
        shutil.rmtree(repository / name)
    print("measuring bare onnxruntime ...")
    bare = bare_onnxruntime(repository, inputs, seconds=2.0)
    server = GeserveProcess(work / "geserve.log", f"--model-repository={repository}").wait_live()
    runs: list[dict[str, Any]] = []
    try:
        assert http_status(f"http://{server.url}/v2/health/ready") == 200
        for model, tensors in inputs.items():
            (work / model).mkdir()
            data_file = input_data(work / model, tensors)
            for protocol in ("http", "grpc"):
                port = server.http_port if protocol == "http" else server.grpc_port
                for concurrency in CONCURRENCY:
                    pids = [server.process.pid, *_children(server.process.pid)]
                    before = {pid: _process_usage(pid) for pid in pids}
                    started = time.perf_counter()
                    figures = run_perf_analyzer(
                        tool, model, protocol, port, concurrency, data_file, arguments.interval_ms
                    )
                    elapsed = time.perf_counter() - started
                    after = {pid: _process_usage(pid) for pid in pids if Path(f"/proc/{pid}").exists()}
                    figures["front_end_rss_mb"] = after[server.process.pid][0] / 2**20
                    figures["front_end_cpu"] = (after[server.process.pid][1] - before[server.process.pid][1]) / elapsed
                    workers = [pid for pid in after if pid != server.process.pid]
                    figures["workers_rss_mb"] = sum(after[pid][0] for pid in workers) / 2**20
                    figures["workers_cpu"] = sum(after[pid][1] - before[pid][1] for pid in workers) / elapsed
                    runs.append({"model": model, "protocol": protocol, "concurrency": concurrency, **figures})
                    print(f"{model:8} {protocol:4} c={concurrency:<2} {figures['infer_per_s']:8.0f} infer/s")
    finally:
        server.stop()
    floor: list[dict[str, Any]] = []
    if "identity" in inputs:
        print("measuring the bare echo servers ...")
        floor = echo_floor(tool, input_data(work / "echo", inputs["identity"]), arguments.interval_ms, runs)
    RESULTS.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    report = {"perf_analyzer": tool, "bare_onnxruntime_samples_per_s": bare, "geserve": runs, "echo_floor": floor}
    (RESULTS / f"{stamp}.json").write_text(json.dumps(report, indent=2))
    print(f"\nwrote bench-results/{stamp}.json\n")
    print(table(bare, runs))
    if floor:
        print("\n| identity, c=1 | geserve p50 ms | bare echo p50 ms | geserve ÷ echo |\n|---|---|---|---|")
        for row in floor:
            print(
                f"| {row['protocol']} ({row['echo']}) | {row['geserve_p50_us'] / 1000:.3f} | "
                f"{row['echo_p50_us'] / 1000:.3f} | {row['geserve_p50_us'] / row['echo_p50_us']:.1f}x |"
            )


ECHO_STACKS = {"http": "ASGI app on uvicorn", "grpc": "grpc.aio servicer"}


def echo_floor(tool: str, data_file: Path, interval_ms: int, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """identity at c=1 against a bare echo server on the same stack as geserve's front-end, next to
    geserve's own c=1 figure from `runs`."""
    rows = []
    for protocol, stack in ECHO_STACKS.items():
        (port,) = free_ports(1)
        echo = subprocess.Popen([sys.executable, "-m", "tests.perf.echo_servers", protocol, str(port)], cwd=ROOT)
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline or echo.poll() is not None:
                        raise RuntimeError(f"the {protocol} echo server did not start") from None
                    time.sleep(0.1)
            figures = run_perf_analyzer(tool, "identity", protocol, port, 1, data_file, interval_ms)
        finally:
            echo.terminate()
            echo.wait(10)
        ours = next(r for r in runs if r["model"] == "identity" and r["protocol"] == protocol and r["concurrency"] == 1)
        rows.append(
            {"protocol": protocol, "echo": stack, "geserve_p50_us": ours["p50_us"], "echo_p50_us": figures["p50_us"]}
        )
    return rows


def table(bare: dict[str, dict[int, float]], runs: list[dict[str, Any]]) -> str:
    lines = [
        "| model | protocol | c | infer/s | p50 ms | p99 ms | server queue / compute µs | vs bare ORT batch 1 | vs bare ORT batch 16 | front-end RSS MB, CPU | workers RSS MB, CPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        reference = bare[run["model"]]
        lines.append(
            f"| {run['model']} | {run['protocol']} | {run['concurrency']} | {run['infer_per_s']:.0f} | "
            f"{run['p50_us'] / 1000:.2f} | {run['p99_us'] / 1000:.2f} | {run['queue_us']:.0f} / {run['compute_us']:.0f} | "
            f"{run['infer_per_s'] / reference[1]:.2f}x | {run['infer_per_s'] / reference[16]:.2f}x | "
            f"{run['front_end_rss_mb']:.0f}, {run['front_end_cpu']:.2f} | {run['workers_rss_mb']:.0f}, {run['workers_cpu']:.2f} |"
        )
    lines.append("")
    lines.append("| model | bare onnxruntime samples/s at batch " + ", ".join(str(b) for b in BATCHES) + " |")
    lines.append("|---|---|")
    for model, figures in bare.items():
        lines.append(f"| {model} | " + ", ".join(f"{figures[b]:.0f}" for b in BATCHES) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
