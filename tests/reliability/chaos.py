"""`make chaos`: workers killed, SIGTERM, a full /dev/shm and a shrunk client region, all under checked load."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as client_shm
from tritonclient.utils import InferenceServerException

from tests.reliability.load import (
    Kind,
    Tally,
    Traffic,
    WrongAnswerError,
    build_repository,
    http_binary_simple,
)
from tests.support import GeserveProcess, http_status, segments_of_server, worker_pids, write_identity_model

REPORT = Path(os.environ.get("CHAOS_REPORT", "chaos-report.json"))
Result = dict[str, Any]
SETTLE_S = 0.5  # between two phases: requests in flight across the change count in neither


def model_workers(server: GeserveProcess) -> list[int]:
    """The server's worker processes (not multiprocessing's resource tracker)."""
    workers = []
    for child in worker_pids(server):
        with contextlib.suppress(OSError):
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                workers.append(child)
    return sorted(workers)


def wait_ready(server: GeserveProcess, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if http_status(f"http://{server.url}/v2/health/ready") == 200:
                return True
        time.sleep(0.2)
    return False


def _result(name: str, tally: Tally, checks: dict[str, bool], **facts: Any) -> Result:
    counts = {outcome: tally.total(outcome) for outcome in ("sent", "ok", "failed", "wrong", "lost", "refused")}
    checks = {"no wrong answer": counts["wrong"] == 0, "no request lost": counts["lost"] == 0, **checks}
    return {
        "scenario": name,
        **counts,
        "checks": checks,
        "passed": all(checks.values()),
        **facts,
        "by_kind": tally.as_json(),
    }


def _merged(phases: dict[str, Tally]) -> Tally:
    tally = Tally()
    for phase in phases.values():
        tally.merge(phase)
    return tally


def _stopped_cleanly(server: GeserveProcess) -> tuple[int, list[str]]:
    pid = server.process.pid
    exit_code = server.stop()
    time.sleep(0.3)
    return exit_code, sorted(segments_of_server(pid))


# -- scenarios --------------------------------------------------------------------------------


def kill_workers(workdir: Path, kills: int = 6, every_s: float = 4.0) -> Result:
    """kill -9 one worker after another (each model's in turn) while mixed traffic runs."""
    server = GeserveProcess(workdir / "geserve.log", f"--model-repository={build_repository(workdir)}").wait_live()
    killed = []
    with Traffic(server) as traffic:
        time.sleep(3)
        for round_ in range(kills):
            workers = model_workers(server)
            victim = workers[round_ % len(workers)]
            os.kill(victim, signal.SIGKILL)
            killed.append(victim)
            time.sleep(every_s)
        recovered = wait_ready(server, 60)
        time.sleep(3)  # served again after the last restart
        counts_before_end = traffic.tally.total("ok")
        time.sleep(2)
        serving_after = traffic.tally.total("ok") > counts_before_end
    alive = server.process.poll() is None
    exit_code, leaked = _stopped_cleanly(server)
    return _result(
        "kill -9 workers under load",
        traffic.tally,
        {
            "server alive": alive,
            "every model ready again": recovered,
            "serving after the restarts": serving_after,
            "exit 0 on SIGTERM": exit_code == 0,
            "no segment left": not leaked,
        },
        workers_killed=len(killed),
    )


def sigterm_under_load(workdir: Path) -> Result:
    """SIGTERM while mixed traffic runs: answered, or refused at connect once the listeners close; never lost."""
    server = GeserveProcess(workdir / "geserve.log", f"--model-repository={build_repository(workdir)}").wait_live()
    pid = server.process.pid
    with Traffic(server) as traffic:
        time.sleep(5)
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(90)
        exit_s = time.monotonic() - started
        exit_code = server.stop()  # exited already: this only collects the status and closes the log
        time.sleep(1)
    time.sleep(0.3)
    leaked = sorted(segments_of_server(pid))
    log = server.log()
    return _result(
        "SIGTERM under load",
        traffic.tally,
        {
            "exit 0": exit_code == 0,
            "no segment left": not leaked,
            "no worker killed on the way out": "did not stop" not in log,
        },
        exit_s=round(exit_s, 2),
    )


def _namespace_prefix(size_mib: int) -> tuple[str, ...] | None:
    """A private mount namespace with its own small /dev/shm, or None where this host cannot make one."""
    script = f'mount -t tmpfs -o size={size_mib}m tmpfs /dev/shm && exec "$@"'
    for unshare in (("unshare", "--mount", "--propagation", "private"), ("unshare", "-r", "-m")):
        probe = [*unshare, "sh", "-c", script, "sh", "true"]
        if shutil.which("unshare") and subprocess.run(probe, capture_output=True, check=False).returncode == 0:
            return (*unshare, "sh", "-c", script, "sh")
    return None


def _top_up(fd: int, shm: Path, leave_bytes: int) -> None:
    """Grow the filler so that at most `leave_bytes` stay free; the server's own segments come and go."""
    stat = os.statvfs(shm)
    free = stat.f_bavail * stat.f_frsize
    if free > leave_bytes:
        with contextlib.suppress(OSError):  # taken meanwhile by a segment: the next round tops up
            os.posix_fallocate(fd, os.fstat(fd).st_size, free - leave_bytes)


def _echo(rows: int) -> Callable[[Any, Any, Any], None]:
    def request(client: httpclient.InferenceServerClient, _: Any, rng: Any) -> None:
        data = np.full((1, rows), rng.random(), dtype=np.float32)
        tensor = httpclient.InferInput("INPUT0", [1, rows], "FP32")
        tensor.set_data_from_numpy(data, binary_data=True)
        output = httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)
        result = client.infer("echo", [tensor], outputs=[output])
        if not np.array_equal(result.as_numpy("OUTPUT0"), data):
            raise WrongAnswerError("echo OUTPUT0 != INPUT0")

    return request


def _http(server: GeserveProcess) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.url, network_timeout=30)


def shm_nearly_full(workdir: Path, phase_s: float = 6.0) -> Result:
    """/dev/shm (a private 128 MiB tmpfs) filled to within 256 KiB while small and large tensors flow."""
    prefix = _namespace_prefix(128)
    if prefix is None:
        return {
            "scenario": "/dev/shm nearly full",
            "skipped": "no private mount namespace (needs unshare and CAP_SYS_ADMIN or user namespaces)",
            "passed": True,
        }
    repository = workdir / "models"
    write_identity_model(repository, "echo", max_batch_size=8)
    server = GeserveProcess(
        workdir / "geserve.log", f"--model-repository={repository}", "--worker-arena-size=1048576", prefix=prefix
    ).wait_live()
    shm = Path(f"/proc/{server.process.pid}/root/dev/shm")
    kinds = (
        Kind("HTTP binary / echo, 1 KiB (fits the arena)", 3, _http, _echo(256)),
        Kind("HTTP binary / echo, 2 MiB (needs its own segment)", 2, _http, _echo(512 * 1024)),
    )
    phases: dict[str, Tally] = {}
    baseline = segments_of_server(server.process.pid, shm)  # the workers' arenas
    with Traffic(server, kinds, bursty=False) as traffic:
        time.sleep(phase_s)
        phases["before"], traffic.tally = traffic.tally, Tally()
        filler = shm / "chaos-filler"
        full_until = time.monotonic() + phase_s
        with filler.open("wb") as handle:
            while time.monotonic() < full_until:
                _top_up(handle.fileno(), shm, leave_bytes=256 << 10)
                time.sleep(0.02)
        phases["full"], traffic.tally = traffic.tally, Tally()
        filler.unlink()
        time.sleep(SETTLE_S)  # requests that were already refused for space are answered meanwhile
        phases["freeing"], traffic.tally = traffic.tally, Tally()
        time.sleep(phase_s)
        phases["after"] = traffic.tally
    time.sleep(SETTLE_S)
    # One-off segments still there once traffic stopped.
    left_in_namespace = sorted(segments_of_server(server.process.pid, shm) - baseline)
    alive = server.process.poll() is None
    exit_code, _ = _stopped_cleanly(server)  # the namespace's /dev/shm goes with it; counted above instead
    tally = _merged(phases)
    full = phases["full"].as_json()
    small_ok_while_full = full.get(kinds[0].name, {}).get("ok", 0)
    return _result(
        "/dev/shm nearly full",
        tally,
        {
            "server alive": alive,
            "small tensors served while full": small_ok_while_full > 0,
            "no failure before filling": phases["before"].total("failed") == 0,
            "no failure after freeing": phases["after"].total("failed") == 0,
            "one-off segments all removed": not left_in_namespace,
            "exit 0 on SIGTERM": exit_code == 0,
        },
        phases={name: phase.as_json() for name, phase in phases.items()},
    )


def shrunk_region(workdir: Path, phase_s: float = 4.0) -> Result:
    """A registered client region truncated to 0 bytes under load, then replaced and registered again."""
    repository = workdir / "models"
    shutil.copytree(build_repository(workdir / "full") / "simple", repository / "simple")
    server = GeserveProcess(
        workdir / "geserve.log", f"--model-repository={repository}", "--allow-client-shm=true"
    ).wait_live()
    key = f"geserve-chaos-{os.getpid()}"
    region = "chaos_inputs"
    handle = client_shm.create_shared_memory_region(region, f"/{key}", 128)
    left, right = np.arange(16, dtype=np.int32), np.full(16, 7, dtype=np.int32)

    client_shm.set_shared_memory_region(handle, [left, right])
    httpclient.InferenceServerClient(server.url).register_system_shared_memory(region, f"/{key}", 128)

    def from_region(client: Any, _: Any, __: Any) -> None:
        module = httpclient if isinstance(client, httpclient.InferenceServerClient) else grpcclient
        inputs = [module.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
        inputs[0].set_shared_memory(region, 64, offset=0)
        inputs[1].set_shared_memory(region, 64, offset=64)
        result = client.infer("simple", inputs)
        if not np.array_equal(result.as_numpy("OUTPUT0"), (left + right).reshape(1, 16)):
            raise WrongAnswerError("simple OUTPUT0 from the region != INPUT0 + INPUT1")

    kinds = (
        Kind("HTTP binary / simple, no region", 2, _http, lambda client, _, rng: http_binary_simple(client, rng)),
        Kind("HTTP / simple, inputs in the region", 2, _http, from_region),
        Kind(
            "gRPC / simple, inputs in the region",
            2,
            lambda server: grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}"),
            from_region,
        ),
    )
    phases: dict[str, Tally] = {}
    try:
        with Traffic(server, kinds, bursty=False) as traffic:
            time.sleep(phase_s)
            phases["before"], traffic.tally = traffic.tally, Tally()
            os.truncate(f"/dev/shm/{key}", 0)
            time.sleep(phase_s)
            phases["shrunk"], traffic.tally = traffic.tally, Tally()
            # Restored as a client would: a new segment with the data in place, swapped in atomically (the
            # server refuses the replaced segment until the region is registered again), then re-registered.
            replacement = Path(f"/dev/shm/{key}.new")
            replacement.write_bytes(left.tobytes() + right.tobytes())
            replacement.rename(f"/dev/shm/{key}")
            control = httpclient.InferenceServerClient(server.url)
            control.unregister_system_shared_memory(region)
            control.register_system_shared_memory(region, f"/{key}", 128)
            time.sleep(SETTLE_S)
            phases["restoring"], traffic.tally = traffic.tally, Tally()
            time.sleep(phase_s)
            phases["restored"] = traffic.tally
    finally:
        with contextlib.suppress(FileNotFoundError):
            client_shm.destroy_shared_memory_region(handle)
    alive = server.process.poll() is None
    exit_code, leaked = _stopped_cleanly(server)
    shrunk = phases["shrunk"].as_json()
    texts = [text for counts in shrunk.values() for text in counts["errors"]]
    tally = _merged(phases)
    return _result(
        "client region shrunk to 0 bytes",
        tally,
        {
            "server alive": alive,
            "requests without the region unaffected": phases["shrunk"].kinds[kinds[0].name].failed == 0,
            "every refusal names the region": bool(texts) and all(region in text for text in texts),
            "region served again once restored": phases["restored"].total("failed") == 0,
            "no failure before": phases["before"].total("failed") == 0,
            "exit 0 on SIGTERM": exit_code == 0,
            "no segment left": not leaked,
        },
        phases={name: phase.as_json() for name, phase in phases.items()},
    )


def _hostile_infer(server: GeserveProcess, **options: Any) -> int:
    """One request to `simple` with an oversized id or parameters: its HTTP status."""
    client = httpclient.InferenceServerClient(server.url, network_timeout=60.0)
    try:
        tensors = []
        for name in ("INPUT0", "INPUT1"):
            tensor = httpclient.InferInput(name, [1, 16], "INT32")
            tensor.set_data_from_numpy(np.arange(16, dtype=np.int32).reshape(1, 16))
            tensors.append(tensor)
        client.infer("simple", tensors, **options)
        return 200
    except InferenceServerException as error:
        return int(error.status() or 0)
    except OSError:  # a timeout or a closed connection: the request was lost
        return 0
    finally:
        client.close()


def oversized_requests(workdir: Path, phase_s: float = 8.0) -> Result:
    """10 MiB ids, 100k parameters, and parameters within the limits yet larger than a worker's pipe, sent
    beside checked load: the first two get a 400, the last are served, and no other request fails."""
    server = GeserveProcess(workdir / "geserve.log", f"--model-repository={build_repository(workdir)}").wait_live()
    statuses: dict[str, list[int]] = {"10 MiB id": [], "100k parameters": [], "900 KiB of parameters": []}
    with Traffic(server) as traffic:
        deadline = time.monotonic() + phase_s
        while time.monotonic() < deadline:
            statuses["10 MiB id"].append(_hostile_infer(server, request_id="i" * (10 << 20)))
            many = {f"k{index}": index for index in range(100_000)}
            statuses["100k parameters"].append(_hostile_infer(server, parameters=many))
            large = {f"k{index:04d}": "v" * 900 for index in range(1000)}
            statuses["900 KiB of parameters"].append(_hostile_infer(server, parameters=large))
    exit_code = server.stop()
    return _result(
        "oversized ids and parameters",
        traffic.tally,
        {
            "oversized ones refused with 400": all(
                code == 400 for name in ("10 MiB id", "100k parameters") for code in statuses[name]
            ),
            "large ones within the limits served": all(code == 200 for code in statuses["900 KiB of parameters"]),
            "no other request failed": traffic.tally.total("failed") == 0,
            "exit 0": exit_code == 0,
        },
        hostile={name: len(codes) for name, codes in statuses.items()},
    )


SCENARIOS = {
    "kill": kill_workers,
    "sigterm": sigterm_under_load,
    "shm-full": shm_nearly_full,
    "shrunk-region": shrunk_region,
    "oversized": oversized_requests,
}


def table(results: list[Result]) -> str:
    lines = [
        "| scenario | requests | ok | failed (answered with an error) | wrong | lost | refused at connect | passed |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for result in results:
        if "skipped" in result:
            lines.append(f"| {result['scenario']} | skipped: {result['skipped']} | | | | | | |")
            continue
        lines.append(
            f"| {result['scenario']} | {result['sent']} | {result['ok']} | {result['failed']} | {result['wrong']} "
            f"| {result['lost']} | {result['refused']} | {'yes' if result['passed'] else 'NO'} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    chosen = argv or list(SCENARIOS)
    results = []
    with tempfile.TemporaryDirectory(prefix="geserve-chaos-") as folder:
        for name in chosen:
            workdir = Path(folder) / name
            workdir.mkdir()
            print(f"chaos: {name} ...", flush=True)
            result = SCENARIOS[name](workdir)
            results.append(result)
            failed_checks = [check for check, ok in result.get("checks", {}).items() if not ok]
            print(
                f"chaos: {name}: {'passed' if result['passed'] else 'FAILED ' + ', '.join(failed_checks)}", flush=True
            )
            if not result["passed"]:
                shutil.copy(workdir / "geserve.log", REPORT.with_suffix(f".{name}.log"))
    REPORT.write_text(json.dumps({"scenarios": results, "passed": all(r["passed"] for r in results)}, indent=2) + "\n")
    print(table(results))
    print(f"report: {REPORT.resolve()}")
    return 0 if all(result["passed"] for result in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
