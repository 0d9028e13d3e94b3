"""`make chaos`: workers killed, SIGTERM (to the server and to its process group, and during a warmup that never
returns), a full /dev/shm, a shrunk client region, a flood of regions, hostile clients, BLS cycles, oversized ids and
parameters, large JSON bodies and an object store that hangs, all under checked load."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as client_shm
from tritonclient.utils import InferenceServerException

from geserve.settings import DEFAULT_MAX_JSON_SIZE
from tests.reliability.load import (
    MIXED,
    Kind,
    Tally,
    Traffic,
    WrongAnswerError,
    build_repository,
    http_binary_simple,
)
from tests.s3_server import S3Server
from tests.support import (
    GeserveProcess,
    binary_infer_request,
    descendants,
    http_status,
    segments_of_server,
    worker_pids,
    write_identity_model,
    write_sum_model,
)

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


def _still_running(pids: list[int], wait_s: float) -> list[int]:
    """Those of `pids` still running (zombies have exited) after up to `wait_s`."""

    def running(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return False

    deadline = time.monotonic() + wait_s
    while (left := [pid for pid in pids if running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def group_sigterm_while_draining(workdir: Path, drain_s: int = 3) -> Result:
    """SIGTERM to the whole process group (systemd's KillMode=control-group, Ctrl-C, `tini -g`) with a drain
    window: the workers leave the signal to the server, so every request of the window is answered."""
    repository = build_repository(workdir)
    server = GeserveProcess(
        workdir / "geserve.log", f"--model-repository={repository}", f"--drain-delay-secs={drain_s}", new_session=True
    ).wait_live()
    pid = server.process.pid
    tree = descendants(pid)
    with Traffic(server) as traffic:
        time.sleep(3)
        before = traffic.tally.total("ok")
        os.killpg(pid, signal.SIGTERM)
        time.sleep(drain_s - 0.5)  # inside the window: everything sent so far must have been answered
        failed_in_window = traffic.tally.total("failed")
        served_in_window = traffic.tally.total("ok") - before
        traffic.finish()
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.process.wait(90)  # it exits on its own once the window is over
    exit_code = server.stop()  # exited already: this only collects the status and closes the log
    left = _still_running(tree, 10.0)
    return _result(
        "SIGTERM to the process group while draining",
        traffic.tally,
        {
            "no failure in the drain window": failed_in_window == 0,
            "served in the drain window": served_in_window > 0,
            "exit 0": exit_code == 0,
            "no process left": not left,
            "no segment left": not segments_of_server(pid),
        },
        served_in_window=served_in_window,
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


def _oversized_head(server: GeserveProcess) -> bool:
    """A request head of 1 MiB: answered 431, the connection closed."""
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=15) as sock:
        with contextlib.suppress(OSError):  # answered and closed before all of it was taken
            sock.sendall(b"GET /v2/health/ready HTTP/1.1\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n")
        answer = b""
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                answer += chunk
    return answer.startswith(b"HTTP/1.1 431 ")


def _unread_response(server: GeserveProcess, elements: int) -> socket.socket:
    """A connection that asks for `elements` FP32 values back and reads none of them."""
    head, body = binary_infer_request(np.ones((1, elements), dtype=np.float32))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", server.http_port))
    sock.sendall(head + body)
    return sock


def _dropped_by_server(sock: socket.socket) -> bool:
    """The server closed it (EOF or reset) before the client had read its response."""
    received = 0
    try:
        while chunk := sock.recv(1 << 20):
            received += len(chunk)
    except ConnectionResetError:
        pass
    except OSError:
        return False  # timed out: still held open
    finally:
        sock.close()
    return received < (4 << 20) * 4


def hostile_clients(workdir: Path, phase_s: float = 6.0, unread: int = 8) -> Result:
    """Under checked traffic: 1 MiB request heads, and connections that ask for 16 MiB and never read it."""
    repository = build_repository(workdir)
    write_identity_model(repository, "echo", max_batch_size=8)
    server = GeserveProcess(
        workdir / "geserve.log", f"--model-repository={repository}", "--http-send-timeout-secs=2"
    ).wait_live()
    frontend = server.process.pid
    with Traffic(server) as traffic:
        time.sleep(SETTLE_S)
        idle_rss = _rss_mib(frontend)
        heads_refused = all(_oversized_head(server) for _ in range(20))
        held = [_unread_response(server, 4 << 20) for _ in range(unread)]
        time.sleep(phase_s)
        all_dropped = all(_dropped_by_server(sock) for sock in held)
        time.sleep(SETTLE_S)
        rss_after = _rss_mib(frontend)
    alive = wait_ready(server, 10)
    log = server.log()
    exit_code, leaked = _stopped_cleanly(server)
    return _result(
        "hostile clients",
        traffic.tally,
        {
            "1 MiB heads answered 431": heads_refused,
            "unread responses dropped by the server": all_dropped,
            "their drops logged": "went unread for 2 seconds" in log,
            "front-end RSS back within 256 MiB": rss_after - idle_rss < 256,
            "no failure": traffic.tally.total("failed") == 0,
            "server alive": alive,
            "exit 0 on SIGTERM": exit_code == 0,
            "no segment left": not leaked,
        },
        frontend_rss_mib={"before": idle_rss, "after": rss_after},
    )


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def region_flood(workdir: Path, cap: int = 64) -> Result:
    """A client registers regions until refused (each holds a descriptor of the server's) under load: it is refused
    at the cap naming the flag, the traffic is unaffected, and unregistering makes room again."""
    repository = workdir / "models"
    shutil.copytree(build_repository(workdir / "full") / "simple", repository / "simple")
    server = GeserveProcess(
        workdir / "geserve.log",
        f"--model-repository={repository}",
        "--allow-client-shm=true",
        f"--max-client-shm-regions={cap}",
    ).wait_live()
    key = f"geserve-chaos-flood-{os.getpid()}"
    handle = client_shm.create_shared_memory_region("flood", f"/{key}", 64)
    client = _http(server)
    refusal, registered = "", 0
    kinds = (Kind("HTTP binary / simple", 3, _http, lambda client, _, rng: http_binary_simple(client, rng)),)
    try:
        with Traffic(server, kinds) as traffic:
            time.sleep(1)
            for index in range(cap * 2):
                try:
                    client.register_system_shared_memory(f"flood_{index}", f"/{key}", 64)
                    registered += 1
                except Exception as error:  # the refusal, kept for the checks
                    refusal = str(error)
                    break
            time.sleep(1)
            client.unregister_system_shared_memory()
            client.register_system_shared_memory("after", f"/{key}", 64)
            room_again = [region["name"] for region in client.get_system_shared_memory_status()] == ["after"]
            time.sleep(1)
    finally:
        client_shm.destroy_shared_memory_region(handle)
    exit_code, leaked = _stopped_cleanly(server)
    return _result(
        "client regions registered until refused",
        traffic.tally,
        {
            "refused at the cap": registered == cap,
            "the refusal names the flag": "--max-client-shm-regions" in refusal,
            "no request failed": traffic.tally.total("failed") == 0,
            "room again after unregistering": room_again,
            "exit 0 on SIGTERM": exit_code == 0,
            "no segment left": not leaked,
        },
        registered=registered,
    )


FREE_GIB = 1 << 30


def _free_region(key: str, size: int, values: dict[int, float]) -> float:
    """A sparse segment of `size` bytes holding float32 `values` at those element indexes: their sum."""
    with open(f"/dev/shm/{key}", "w+b") as segment:
        os.ftruncate(segment.fileno(), size)
        for index, value in values.items():
            os.pwrite(segment.fileno(), np.float32(value).tobytes(), index * 4)
    return float(sum(values.values()))


def _sum_from_region(region: str, key: str, expected: float) -> Callable[[Any, Any, Any], None]:
    def request(client: Any, _: Any, __: Any) -> None:
        inputs = [httpclient.InferInput("X", [FREE_GIB // 4], "FP32")]
        inputs[0].set_shared_memory(region, FREE_GIB)
        total = client.infer("sum", inputs).as_numpy("Y").tolist()
        if total != [expected]:
            raise WrongAnswerError(f"sum of the free GiB in '{region}' = {total}, not [{expected}]")

    return request


def _server_memory_mib(server: GeserveProcess) -> float:
    total = 0.0
    for pid in [server.process.pid, *descendants(server.process.pid)]:
        with contextlib.suppress(OSError):
            total += _rss_mib(pid)
    return total


def free_input(workdir: Path, phase_s: float = 10.0, bound_mib: float = 256.0) -> Result:
    """Valid 1 GiB inputs read from sparse client regions (free to their clients) beside checked load, while one
    more region is shrunk to nothing during its own requests: every answer is right or (for the shrunk one) an
    error naming its region, the server's memory (all its processes) never grows by `bound_mib`, the regions stay
    sparse, and no worker dies."""
    repository = workdir / "models"
    shutil.copytree(build_repository(workdir / "full") / "simple", repository / "simple")
    write_sum_model(repository)
    server = GeserveProcess(
        workdir / "geserve.log", f"--model-repository={repository}", "--allow-client-shm=true"
    ).wait_live()
    control = _http(server)
    keys = [f"geserve-chaos-free-{os.getpid()}-{index}" for index in range(3)]
    sums = [
        _free_region(key, FREE_GIB, {0: 1.0, 1000 + index: 2.0, FREE_GIB // 4 - 1: 4.0})
        for index, key in enumerate(keys)
    ]
    for index, key in enumerate(keys):
        control.register_system_shared_memory(f"free_{index}", f"/{key}", FREE_GIB)
    kinds = (
        Kind("HTTP binary / simple", 2, _http, lambda client, _, rng: http_binary_simple(client, rng)),
        *(
            Kind(
                f"HTTP / sum of a free GiB ({index})",
                1,
                _http,
                _sum_from_region(f"free_{index}", keys[index], sums[index]),
            )
            for index in range(2)
        ),
    )
    workers_before = model_workers(server)
    baseline, peak = _server_memory_mib(server), 0.0
    shrunk = {"answered right": 0, "refused before it was read": 0, "refused as read while it shrank": 0, "other": 0}
    others: list[str] = []
    rng = np.random.default_rng(7)
    try:
        with Traffic(server, kinds, bursty=False) as traffic:
            deadline = time.monotonic() + phase_s
            while time.monotonic() < deadline:
                # The third region: refilled, then shrunk to nothing at a random moment of its own request.
                _free_region(keys[2], FREE_GIB, {FREE_GIB // 4 - 1: 3.0})  # its last page is read last
                outcome: list[Any] = []
                request = threading.Thread(
                    target=_attempt, args=(_sum_from_region("free_2", keys[2], 3.0), _http(server), outcome)
                )
                request.start()
                time.sleep(float(rng.uniform(0.0, 0.6)))
                os.truncate(f"/dev/shm/{keys[2]}", 0)
                while request.is_alive():
                    request.join(0.05)
                    peak = max(peak, _server_memory_mib(server))
                error = outcome[0] if outcome else "no outcome"
                if error is None:
                    shrunk["answered right"] += 1
                elif "'free_2' shrank while" in str(error):
                    shrunk["refused as read while it shrank"] += 1
                elif "'free_2' shrank to" in str(error):
                    shrunk["refused before it was read"] += 1
                else:
                    shrunk["other"] += 1
                    others.append(str(error)[:200])
            blocks = [os.stat(f"/dev/shm/{key}").st_blocks * 512 for key in keys[:2]]
    finally:
        for key in keys:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{key}")
    workers_after = model_workers(server)
    alive = server.process.poll() is None
    exit_code, leaked = _stopped_cleanly(server)
    return _result(
        "free GiB inputs from sparse client regions, one shrunk while read",
        traffic.tally,
        {
            "server alive": alive,
            "no request failed": traffic.tally.total("failed") == 0,
            f"memory grew by less than {bound_mib:.0f} MiB": peak - baseline < bound_mib,
            "regions still sparse": all(size < 16 << 20 for size in blocks),
            "the shrunk region's requests answered right or refused naming it": shrunk["other"] == 0,
            "no worker died": workers_before == workers_after,
            "exit 0 on SIGTERM": exit_code == 0,
            "no segment left": not leaked,
        },
        memory_mib={"baseline": round(baseline), "peak": round(peak)},
        shrunk=shrunk,
        shrunk_other_errors=others[:5],
    )


def _attempt(request: Callable[[Any, Any, Any], None], client: Any, outcome: list[BaseException | None]) -> None:
    """Send one request; its error (None: answered right) goes in `outcome`."""
    try:
        request(client, None, None)
        outcome.append(None)
    except BaseException as error:  # the outcome is what is checked
        outcome.append(error)
    finally:
        client.close()


BLS_CYCLE = "BLS call cycle"


def _bls_repository(workdir: Path) -> Path:
    """simple, repeat_int32, bls_abandon (reads one response of each BLS stream) and bls_self (one instance,
    calling itself through BLS without a timeout)."""
    repository = workdir / "models"
    full = build_repository(workdir / "full")
    for name in ("simple", "repeat_int32"):
        shutil.copytree(full / name, repository / name)
    python_models = Path(__file__).resolve().parents[1] / "python_models"
    shutil.copytree(python_models / "bls_abandon", repository / "bls_abandon")
    shutil.copytree(python_models / "bls_recurse", repository / "bls_self")
    config = repository / "bls_self" / "config.pbtxt"
    config.write_text(config.read_text().replace('"bls_recurse"', '"bls_self"').replace("count: 2", "count: 1"))
    return repository


def _int32(module: Any, name: str, values: np.ndarray) -> Any:
    tensor = module.InferInput(name, list(values.shape), "INT32")
    tensor.set_data_from_numpy(values)
    return tensor


def _self_call(client: Any, _: Any, __: Any) -> None:
    """bls_self calling itself: answered at once with the cycle's error, never a hang."""
    try:
        client.infer("bls_self", [_int32(httpclient, "DEPTH", np.array([1], dtype=np.int32))])
    except InferenceServerException as error:
        if BLS_CYCLE not in str(error):
            raise
        return
    raise WrongAnswerError("bls_self answered a call to itself")


def _abandoned_stream(client: Any, _: Any, rng: Any) -> None:
    first = rng.randrange(1000)
    values = np.array([first, 2, 3, 4, 5, 6], dtype=np.int32)
    result = client.infer("bls_abandon", [_int32(httpclient, "IN", values)])
    if result.as_numpy("OUT").tolist() != [first]:
        raise WrongAnswerError(f"bls_abandon OUT != [{first}]")


def bls_cycles(workdir: Path, phase_s: float = 6.0) -> Result:
    """Under good traffic: a model calling itself through BLS (refused as a cycle, at once), and a model leaving
    decoupled BLS streams unread (their segments freed): both go on for `phase_s`, and nothing piles up."""
    server = GeserveProcess(workdir / "geserve.log", f"--model-repository={_bls_repository(workdir)}").wait_live()
    pid = server.process.pid
    base = len(segments_of_server(pid))
    kinds = (
        Kind("HTTP binary / simple", 2, _http, lambda client, _, rng: http_binary_simple(client, rng)),
        Kind("HTTP / bls_self calling itself (the cycle's error is the answer)", 2, _http, _self_call),
        Kind("HTTP / bls_abandon (BLS streams left unread)", 2, _http, _abandoned_stream),
    )
    with Traffic(server, kinds, bursty=False) as traffic:
        time.sleep(phase_s)
    deadline = time.monotonic() + 30
    while len(segments_of_server(pid)) > base and time.monotonic() < deadline:
        time.sleep(0.2)  # the streams' last responses still arriving, then freed
    extra = len(segments_of_server(pid)) - base
    alive = server.process.poll() is None
    exit_code, leaked = _stopped_cleanly(server)
    return _result(
        "BLS cycles and abandoned BLS streams",
        traffic.tally,
        {
            "server alive": alive,
            "every request answered as expected": traffic.tally.total("failed") == 0,
            "each kind served": all(
                kind.name in traffic.tally.kinds and traffic.tally.kinds[kind.name].ok > 0 for kind in kinds
            ),
            "no segments piled up": extra <= 0,
            "exit 0 on SIGTERM": exit_code == 0,
            "no segment left": not leaked,
        },
        extra_segments=extra,
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
            # A 10 MiB id makes JSON past --http-max-json-size: 413 before the id is read.
            "oversized ones refused with 400 or 413": all(
                code in (400, 413) for name in ("10 MiB id", "100k parameters") for code in statuses[name]
            ),
            "large ones within the limits served": all(code == 200 for code in statuses["900 KiB of parameters"]),
            "no other request failed": traffic.tally.total("failed") == 0,
            "exit 0": exit_code == 0,
        },
        hostile={name: len(codes) for name, codes in statuses.items()},
    )


def _health_delays(server: GeserveProcess, stop: threading.Event, delays: list[float]) -> None:
    """/v2/health/live asked every 20 ms until `stop`: how long each answer took."""
    while not stop.is_set():
        started = time.monotonic()
        with contextlib.suppress(OSError):
            http_status(f"http://{server.url}/v2/health/live")
        delays.append(time.monotonic() - started)
        time.sleep(0.02)


def large_json(workdir: Path, phase_s: float = 8.0, stall_bound_s: float = 0.25) -> Result:
    """JSON tensor data just under --http-max-json-size (its default), and past it, sent beside checked load while a
    liveness probe asks every 20 ms: the probe is never held up more than `stall_bound_s`, the large ones are
    answered (400 for the shape `simple` refuses, 413 past the limit), and no other request fails."""
    server = GeserveProcess(workdir / "geserve.log", f"--model-repository={build_repository(workdir)}").wait_live()
    values = (DEFAULT_MAX_JSON_SIZE - 200) // len("7, ")  # just under the limit
    under = json.dumps({"inputs": [{"name": "INPUT0", "shape": [values], "datatype": "INT32", "data": [7] * values}]})
    statuses: dict[str, list[int]] = {"under the limit": [], "past the limit": []}
    delays: list[float] = []
    stop = threading.Event()
    probe = threading.Thread(target=_health_delays, args=(server, stop, delays), daemon=True)
    with Traffic(server) as traffic:
        probe.start()
        deadline = time.monotonic() + phase_s
        while time.monotonic() < deadline:
            statuses["under the limit"].append(_post_status(server, "/v2/models/simple/infer", under.encode()))
            past = b'{"inputs": [' + b" " * DEFAULT_MAX_JSON_SIZE + b"]}"
            statuses["past the limit"].append(_post_status(server, "/v2/models/simple/infer", past))
        stop.set()
        probe.join()
    exit_code = server.stop()
    worst = max(delays, default=0.0)
    return _result(
        "large JSON bodies",
        traffic.tally,
        {
            f"liveness never held up over {stall_bound_s} s": worst < stall_bound_s,
            "under the limit answered (400: shape)": all(code == 400 for code in statuses["under the limit"]),
            "past the limit refused with 413": all(code == 413 for code in statuses["past the limit"]),
            "no other request failed": traffic.tally.total("failed") == 0,
            "exit 0": exit_code == 0,
        },
        worst_health_s=round(worst, 3),
        large={name: len(codes) for name, codes in statuses.items()},
    )


def _post_status(server: GeserveProcess, path: str, body: bytes) -> int:
    request = urllib.request.Request(f"http://{server.url}{path}", data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        with error:
            return int(error.code)
    except OSError:
        return 0


_NEVER_WARM = """
import threading


class TritonPythonModel:
    def execute(self, requests):
        threading.Event().wait()
"""
_NEVER_WARM_CONFIG = """
name: "never_warm" backend: "python" max_batch_size: 1
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 2 ] } ]
model_warmup [ { name: "forever" batch_size: 1
  inputs { key: "INPUT0" value: { data_type: TYPE_FP32 dims: [ 2 ] zero_data: true } } } ]
"""


def stuck_warmup(workdir: Path, exit_timeout_s: int = 5) -> Result:
    """SIGTERM while a startup model's warmup never returns: the server exits within --exit-timeout-secs (+1 s, and
    the time to reap its processes), 0, with no segment or process of it left."""
    repository = build_repository(workdir)
    folder = repository / "never_warm"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.py").write_text(_NEVER_WARM)
    (folder / "config.pbtxt").write_text(_NEVER_WARM_CONFIG)
    server = GeserveProcess(
        workdir / "geserve.log", f"--model-repository={repository}", f"--exit-timeout-secs={exit_timeout_s}"
    )
    deadline = time.monotonic() + 60
    while "instance never_warm_0 of model 'never_warm' is up" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    tree = descendants(server.process.pid)
    pid = server.process.pid
    started = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    server.process.wait(120)
    exit_s = time.monotonic() - started
    exit_code = server.stop()
    time.sleep(0.3)
    left = _still_running(tree, 2.0)
    return _result(
        "SIGTERM during a warmup that never returns",
        Tally(),
        {
            f"exit within {exit_timeout_s + 1} s": exit_s <= exit_timeout_s + 1,
            "exit 0": exit_code == 0,
            "no process left": not left,
            "no segment left": not segments_of_server(pid),
        },
        exit_s=round(exit_s, 2),
    )


def _timed(delays: list[float], request: Callable[[Any, Any, Any], None]) -> Callable[[Any, Any, Any], None]:
    """`request`, with how long each call took appended to `delays`."""

    def timed(client: Any, state: Any, rng: Any) -> None:
        started = time.monotonic()
        try:
            request(client, state, rng)
        finally:
            delays.append(time.monotonic() - started)

    return timed


def _index_request(models: set[str]) -> Callable[[Any, Any, Any], None]:
    def request(client: httpclient.InferenceServerClient, _: Any, __: Any) -> None:
        entries = {(entry["name"], entry.get("state")) for entry in client.get_model_repository_index()}
        if entries != {(name, "READY") for name in models}:
            raise WrongAnswerError(f"repository index {sorted(entries)} != every model READY")

    return request


def _large_strings(client: httpclient.InferenceServerClient, _: Any, rng: Any) -> None:
    """1000 BYTES elements of 300 bytes: past 256 KiB, so the server checks them on a thread of its default pool."""
    data = np.array([bytes([rng.randrange(65, 91)]) * 300 for _ in range(1000)], dtype=np.object_)
    tensor = httpclient.InferInput("INPUT0", [1000], "BYTES")
    tensor.set_data_from_numpy(data, binary_data=True)
    result = client.infer("strings", [tensor], outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)])
    answer = result.as_numpy("OUTPUT0")
    if answer is None or answer.tolist() != data.tolist():
        raise WrongAnswerError("strings OUTPUT0 != INPUT0")


def store_outage(workdir: Path, phase_s: float = 5.0, outage_s: float = 30.0, bound_s: float = 2.0) -> Result:
    """A repository in S3 (moto's server), polled every second, whose store hangs for `outage_s` (the process
    stopped: connections accepted, nothing answered), longer than a listing takes to give up: mixed traffic, large
    BYTES requests (checked on the loop's default pool) and repository index calls are all served, each of the last
    two within `bound_s`; the failed poll is logged once, and the recovery once."""
    s3 = S3Server(workdir / "moto.log")
    try:
        s3.client.create_bucket(Bucket="chaos")
        repository = build_repository(workdir)
        write_identity_model(repository, "strings", dtype="TYPE_STRING", max_batch_size=0)
        for folder in sorted(repository.iterdir()):
            s3.upload(folder, "chaos", "models")
        models = {folder.name for folder in repository.iterdir()}
        server = GeserveProcess(
            workdir / "geserve.log",
            f"--model-repository={s3.url('chaos', 'models')}",
            "--model-control-mode=poll",
            "--repository-poll-secs=1",
            env=s3.credentials,
        ).wait_live()
        index_s: list[float] = []
        strings_s: list[float] = []
        kinds = (
            *MIXED,
            Kind("HTTP / repository index", 2, _http, _timed(index_s, _index_request(models))),
            Kind("HTTP binary / strings, 300 KiB of BYTES", 2, _http, _timed(strings_s, _large_strings)),
        )
        phases: dict[str, Tally] = {}
        with Traffic(server, kinds) as traffic:
            time.sleep(phase_s)
            phases["before"], traffic.tally = traffic.tally, Tally()
            with s3.hung():
                index_s.clear()
                strings_s.clear()
                time.sleep(outage_s)
                hung = {"index": list(index_s), "strings": list(strings_s)}
            phases["hung"], traffic.tally = traffic.tally, Tally()
            deadline = time.monotonic() + 30
            while "object storage reachable again" not in server.log() and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(phase_s)
            phases["after"] = traffic.tally
        alive = server.process.poll() is None
        log = server.log()
        exit_code, leaked = _stopped_cleanly(server)
    finally:
        s3.stop()
    worst = {name: round(max(delays, default=0.0), 3) for name, delays in hung.items()}
    return _result(
        "object store hangs",
        _merged(phases),
        {
            "no failure": all(phase.total("failed") == 0 for phase in phases.values()),
            "index and large BYTES served while hung": all(hung.values()),
            f"each within {bound_s} s while hung": max(worst.values()) < bound_s,
            "the failed poll logged once": log.count("polling the model repository failed") == 1,
            "no traceback": "Traceback" not in log,
            "recovery logged once": log.count("object storage reachable again") == 1,
            "server alive": alive,
            "exit 0 on SIGTERM": exit_code == 0,
            "no segment left": not leaked,
        },
        poll_failure=next((line for line in log.splitlines() if "polling the model repository failed" in line), ""),
        while_hung={name: len(delays) for name, delays in hung.items()},
        worst_while_hung_s=worst,
        phases={name: phase.as_json() for name, phase in phases.items()},
    )


SCENARIOS = {
    "kill": kill_workers,
    "sigterm": sigterm_under_load,
    "group-sigterm": group_sigterm_while_draining,
    "region-flood": region_flood,
    "shm-full": shm_nearly_full,
    "shrunk-region": shrunk_region,
    "hostile-clients": hostile_clients,
    "bls-cycles": bls_cycles,
    "oversized": oversized_requests,
    "large-json": large_json,
    "stuck-warmup": stuck_warmup,
    "store-outage": store_outage,
    "free-input": free_input,
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
