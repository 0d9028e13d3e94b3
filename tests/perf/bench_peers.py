"""`make bench-peers`: geserve and MLServer 1.7.1 under the same perf_analyzer runs, alternating A/B."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
from pathlib import Path
from typing import Any

from tests.perf import models
from tests.perf.bench_server import CONCURRENCY, RESULTS, find_perf_analyzer, input_data, run_perf_analyzer
from tests.support import GeserveProcess, free_ports, http_status

CACHE = Path(os.environ.get("GESERVE_BENCH_CACHE", Path.home() / ".cache" / "geserve-bench"))
VENV = CACHE / "mlserver-venv"
# uvloop 0.23 makes MLServer 1.7.1's workers die at start; 0.21 works.
REQUIREMENTS = ["mlserver==1.7.1", "uvloop==0.21.0", "onnxruntime", "numpy"]
PEERS = Path(__file__).resolve().parent / "peers"


def ensure_venv(venv: Path, requirements: list[str], what: str) -> Path:
    """A venv holding `requirements`, made on first use; a marker says the install finished."""
    done = venv / ".geserve-installed"
    if not done.exists():
        print(f"installing {what} into {venv} ...")
        subprocess.run(["python3", "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *requirements], check=True)
        done.write_text(" ".join(requirements))
    return venv


def ensure_mlserver() -> Path:
    return ensure_venv(VENV, REQUIREMENTS, "MLServer") / "bin" / "python"


def mlserver_repository(folder: Path, source: Path, inputs: dict[str, dict[str, tuple[str, list[int]]]]) -> None:
    """The same ONNX files as MLServer models, with adaptive batching (32, 1 ms) and a config for the shim."""
    folder.mkdir(parents=True)
    shutil.copy(PEERS / "onnx_runtime.py", folder / "onnx_runtime.py")
    import onnxruntime as ort

    for name, tensors in inputs.items():
        target = folder / name
        target.mkdir()
        shutil.copy(source / name / "1" / "model.onnx", target / "model.onnx")
        session = ort.InferenceSession(str(target / "model.onnx"), providers=["CPUExecutionProvider"])
        datatype = {"tensor(float)": "FP32", "tensor(int32)": "INT32"}
        outputs = [(o.name, datatype[o.type], list(o.shape[1:])) for o in session.get_outputs()]
        settings = {
            "name": name,
            "implementation": "onnx_runtime.OnnxModel",
            "parameters": {"uri": "./model.onnx"},
            "max_batch_size": 32,
            "max_batch_time": 0.001,
            "inputs": [{"name": n, "datatype": d, "shape": [-1, *dims]} for n, (d, dims) in tensors.items()],
            "outputs": [{"name": n, "datatype": d, "shape": [-1, *dims]} for n, d, dims in outputs],
        }
        (target / "model-settings.json").write_text(json.dumps(settings))
        config = {
            "name": name,
            "platform": "onnxruntime_onnx",
            "max_batch_size": 32,
            "input": [{"name": n, "datatype": d, "dims": dims} for n, (d, dims) in tensors.items()],
            "output": [{"name": n, "datatype": d, "dims": dims} for n, d, dims in outputs],
        }
        (target / "config.json").write_text(json.dumps(config))


class MLServerProcess:
    def __init__(self, python: Path, folder: Path, log: Path, workers: int = 1) -> None:
        self.http_port, self.grpc_port, metrics_port = free_ports(3)
        settings = {"host": "127.0.0.1", "http_port": self.http_port, "grpc_port": self.grpc_port,
                    "metrics_port": metrics_port, "parallel_workers": workers}  # fmt: skip
        (folder / "settings.json").write_text(json.dumps(settings))
        self._log = log.open("wb")
        environment = {**os.environ, "PYTHONPATH": str(folder)}
        self.process = subprocess.Popen(
            [str(python), str(PEERS / "launch_mlserver.py"), str(folder)],
            cwd=folder, stdout=self._log, stderr=subprocess.STDOUT, env=environment,
        )  # fmt: skip
        wait_ready("MLServer", self.process, self.http_port, log, 180)

    def stop(self) -> None:
        stop_process(self.process)
        self._log.close()


def wait_ready(name: str, process: subprocess.Popen[bytes], http_port: int, log: Path, timeout_s: float) -> None:
    """Until the peer answers /v2/health/ready; its log's end if it exits or never gets there."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited:\n{log.read_text()[-3000:]}")
        try:
            if http_status(f"http://127.0.0.1:{http_port}/v2/health/ready") == 200:
                return
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{name} did not become ready:\n{log.read_text()[-3000:]}")


def stop_process(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--interval-ms", type=int, default=2000)
    parser.add_argument("--models", nargs="*", default=["identity", "simple", "mlp"])
    arguments = parser.parse_args()
    tool = find_perf_analyzer()
    python = ensure_mlserver()
    print(f"perf_analyzer: {tool}\nMLServer: {python}")
    work = Path(tempfile.mkdtemp(prefix="geserve-peers-"))
    everything = models.build(work / "geserve")
    inputs = {name: value for name, value in everything.items() if name in arguments.models}
    for name in set(everything) - set(inputs):
        shutil.rmtree(work / "geserve" / name)
    mlserver_repository(work / "mlserver", work / "geserve", inputs)
    geserve = GeserveProcess(work / "geserve.log", f"--model-repository={work / 'geserve'}").wait_live()
    peer = MLServerProcess(python, work / "mlserver", work / "mlserver.log")
    rows: list[dict[str, Any]] = []
    try:
        for model, tensors in inputs.items():
            (work / model).mkdir()
            data = input_data(work / model, tensors)
            for protocol in ("http", "grpc"):
                for concurrency in CONCURRENCY:
                    row: dict[str, Any] = {"model": model, "protocol": protocol, "concurrency": concurrency}
                    # A/B in one run: geserve, then MLServer, for every point.
                    for server, port, formats in (
                        ("geserve", geserve.http_port if protocol == "http" else geserve.grpc_port, []),
                        (
                            "mlserver",
                            peer.http_port if protocol == "http" else peer.grpc_port,
                            ["--input-tensor-format", "json", "--output-tensor-format", "json"]
                            if protocol == "http"
                            else [],
                        ),
                    ):
                        try:
                            row[server] = run_perf_analyzer(
                                tool, model, protocol, port, concurrency, data, arguments.interval_ms, formats
                            )
                        except RuntimeError as error:
                            row[server] = {"error": str(error)[-500:]}
                    rows.append(row)
                    print(_line(row))
    finally:
        geserve.stop()
        peer.stop()
    RESULTS.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (RESULTS / f"peers-{stamp}.json").write_text(json.dumps({"perf_analyzer": tool, "runs": rows}, indent=2))
    print(f"\nwrote bench-results/peers-{stamp}.json\n")
    print(
        "| model | protocol | c | geserve infer/s | MLServer infer/s | ratio | geserve p50 ms | MLServer p50 ms | p50 ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(_line(row))


def _line(row: dict[str, Any]) -> str:
    ours, theirs = row["geserve"], row["mlserver"]
    if "error" in ours or "error" in theirs:
        return f"| {row['model']} | {row['protocol']} | {row['concurrency']} | failed: {ours.get('error', theirs.get('error'))[:200]} |"
    return (
        f"| {row['model']} | {row['protocol']} | {row['concurrency']} | {ours['infer_per_s']:.0f} | "
        f"{theirs['infer_per_s']:.0f} | {ours['infer_per_s'] / theirs['infer_per_s']:.2f}x | "
        f"{ours['p50_us'] / 1000:.2f} | {theirs['p50_us'] / 1000:.2f} | {ours['p50_us'] / theirs['p50_us']:.2f}x |"
    )


if __name__ == "__main__":
    main()
