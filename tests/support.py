"""Test helpers: free ports, a real `python -m geserve` process and its process tree, small model repositories,
keep-alive load."""

from __future__ import annotations

import collections
import contextlib
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from geserve.workers.runs import run_of
from geserve.workers.shm import SHM_DIRECTORY, SHM_PREFIX

ROOT = Path(__file__).resolve().parent.parent
MODEL_REPOSITORY = ROOT / "model_repository"
# Triton's perf_analyzer, built for this glibc, in the project's shared folder (tests/e2e/conftest.py).
PERF_ANALYZER = ROOT.parent / "shared" / "tools" / "perf_analyzer"
# A few short windows; the tests check that perf_analyzer runs against geserve, not how steady the machine is, so any
# three windows count as stable (its stability rule compares windows with each other; on a loaded test machine
# they can differ by more than 100 %).
PERF_ANALYZER_WINDOWS = ("--measurement-interval", "500", "--max-trials", "4", "--stability-percentage", "1000")
# The pids of the geserve servers this test process started (GeserveProcess, unless told it is a stranger's).
SUITE_SERVERS: set[int] = set()
# How many protocol processes the suite's servers run (`--frontend-processes`); unset or empty: 1, one process.
FRONTEND_PROCESSES_VARIABLE = "GESERVE_TEST_FRONTEND_PROCESSES"
FRONTEND_PROCESSES_FLAG = "--frontend-processes"


_HANDED_OUT: set[int] = set()


def free_ports(count: int) -> list[int]:
    """Ports free now, distinct from each other and from every port handed out before in this process.

    All are held open together while they are picked, so one server's HTTP, gRPC and metrics ports
    cannot coincide; and a port handed to one server is never handed to a later one, which might
    otherwise get it back before the first has bound it."""
    sockets: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            sock = socket.socket()
            sockets.append(sock)
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
            if port not in _HANDED_OUT:
                _HANDED_OUT.add(port)
                ports.append(port)
    finally:
        for sock in sockets:
            sock.close()
    return ports


def free_port() -> int:
    return free_ports(1)[0]


def suite_segments(directory: Path = SHM_DIRECTORY) -> set[str]:
    """The geserve segments in `directory` the suite answers for: those of this process's run (the workers
    it starts itself) and of the servers it started, alive or not; not those of another geserve on this
    machine, running or killed (a developer's `make run`, another checkout's tests midway through a crash test)."""
    try:
        names = [entry.name for entry in directory.iterdir() if entry.name.startswith(SHM_PREFIX)]
    except OSError:
        return set()
    ours = {os.getpid(), *SUITE_SERVERS}
    return {name for name in names if (run := run_of(name)) is None or run.pid in ours}


def segments_of_server(pid: int, directory: Path = SHM_DIRECTORY) -> set[str]:
    """The segments of the server whose top-level process is `pid` (their names carry its run's id)."""
    with contextlib.suppress(OSError):
        return {entry.name for entry in directory.iterdir() if (run := run_of(entry.name)) and run.pid == pid}
    return set()


def server_mode() -> int:
    """The `--frontend-processes` the suite's servers get unless a test chooses (GESERVE_TEST_FRONTEND_PROCESSES)."""
    value = os.environ.get(FRONTEND_PROCESSES_VARIABLE, "").strip()
    return int(value) if value else 1


MULTIPROCESS = server_mode() > 1


def with_server_mode(args: tuple[str, ...] | list[str]) -> list[str]:
    """A geserve command line's flags in the suite's mode: `--frontend-processes=N` added when N > 1 and the flags
    do not choose already."""
    chosen = any(arg == FRONTEND_PROCESSES_FLAG or arg.startswith(f"{FRONTEND_PROCESSES_FLAG}=") for arg in args)
    if chosen or server_mode() == 1:
        return list(args)
    return [*args, f"{FRONTEND_PROCESSES_FLAG}={server_mode()}"]


def frontend_processes_of(args: tuple[str, ...] | list[str]) -> int:
    """The protocol processes a geserve command line asks for: 1 unless `--frontend-processes` says otherwise
    (`auto`: 0, as many as the server decides, always more than one process)."""
    value = "1"
    for index, arg in enumerate(args):
        if arg.startswith(f"{FRONTEND_PROCESSES_FLAG}="):
            value = arg.split("=", 1)[1]
        elif arg == FRONTEND_PROCESSES_FLAG and index + 1 < len(args):
            value = args[index + 1]
    return 0 if value == "auto" else int(value)


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        with error:  # an unclosed error response is a ResourceWarning later, in another test
            return int(error.code)


def run_perf_analyzer(perf_analyzer: str, *args: str, timeout_s: float = 300) -> str:
    """perf_analyzer with `args` for a few short windows; returns its output after checking it succeeded."""
    command = [perf_analyzer, *args, *PERF_ANALYZER_WINDOWS]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return output


class GeserveProcess:
    """`python -m geserve` on free loopback ports, its output kept in a log file."""

    def __init__(
        self,
        log_path: Path,
        *args: str,
        env: dict[str, str] | None = None,
        prefix: tuple[str, ...] = (),
        cwd: Path = ROOT,
        suite_owned: bool = True,
        new_session: bool = False,
    ) -> None:
        """`prefix` runs the server under another command that execs it (e.g. `unshare ...`), so the pid is geserve's;
        `cwd` is the checkout whose geserve runs (`python -m` imports from it first); a server not `suite_owned`
        stands for another one on the machine, whose segments the suite's checks leave out; a `new_session` server
        leads its own process group, which a test can signal as a whole (as a container runtime or a terminal does).
        The suite's mode (`server_mode`) adds `--frontend-processes` unless `args` carry it."""
        self.http_port, self.grpc_port, self.metrics_port = free_ports(3)
        self.log_path = log_path
        self._args = args = tuple(with_server_mode(args))
        # 1: one process; otherwise a supervisor, an engine and this many protocol processes (0: the server decides).
        self.frontend_processes = frontend_processes_of(args)
        command = [
            *prefix,
            sys.executable,
            "-m",
            "geserve",
            "--http-address=127.0.0.1",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            *args,
        ]
        self._log = log_path.open("wb")
        environment = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.process = subprocess.Popen(
            command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=environment,
            start_new_session=new_session,
        )
        if suite_owned:
            SUITE_SERVERS.add(self.process.pid)

    @property
    def multiprocess(self) -> bool:
        """A supervisor with an engine and protocol processes, not one process doing everything."""
        return self.frontend_processes != 1

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_live(self, timeout_s: float = 90.0) -> GeserveProcess:
        """Wait until the HTTP endpoint answers live; fail with the log if the process exits."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"geserve exited with {self.process.returncode}:\n{self.log()}")
            try:
                if http_status(f"http://{self.url}/v2/health/live") == 200 and self._metrics_up():
                    return self
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"geserve did not become live in {timeout_s}s:\n{self.log()}")

    def _metrics_up(self) -> bool:
        """The metrics listener starts just after the HTTP one; live means both answer."""
        if "--allow-metrics=false" in self._args:
            return True
        try:
            with socket.create_connection(("127.0.0.1", self.metrics_port), timeout=1):
                return True
        except OSError:
            return False

    def wait_exit(self, timeout_s: float = 90.0) -> int:
        return self.process.wait(timeout_s)

    def stop(self) -> int:
        """SIGTERM, as an orchestrator would; returns the exit status. A server that does not stop is killed with
        every process of its tree, so that none outlives the test."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                tree = descendants(self.process.pid)
                self.process.kill()
                for pid in tree:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                self.process.wait(10)
        if not self._log.closed:
            self._log.close()
        return self.process.returncode


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`, started by any of its threads; none once it is gone."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            found += [int(child) for child in task.read_text().split()]
    return found


def descendants(pid: int) -> list[int]:
    """Every process below `pid`: its children, theirs, and so on (read now: a process that exits is left out)."""
    found: list[int] = []
    pending = children(pid)
    while pending:
        child = pending.pop()
        found.append(child)
        pending += children(child)
    return found


def alive(pid: int) -> bool:
    """Running: neither gone nor a zombie (one that has exited and waits only to be reaped)."""
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def wait_until(condition: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    """Whether `condition` comes true within `timeout_s` (asked every 50 ms, and once more at the end)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def command_line(pid: int) -> list[str]:
    """The arguments process `pid` was started with; empty once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def multiprocess_role(pid: int) -> str | None:
    """`engine` or `protocol` for a process a multi-process server's supervisor forked, else None: each names
    itself (/proc/<pid>/comm `geserve-engine`, `geserve-proto<i>`); its command line stays the supervisor's."""
    try:
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None
    if name == "geserve-engine":
        return "engine"
    if name.startswith("geserve-proto"):
        return "protocol"
    return None


def engine_pid(server: GeserveProcess) -> int:
    """The process that holds the models, their workers and all server state: the engine under a supervisor, the
    server's own process when it runs alone."""
    if not server.multiprocess:
        return server.process.pid
    engines = [pid for pid in children(server.process.pid) if multiprocess_role(pid) == "engine"]
    assert len(engines) == 1, f"engines under the supervisor {server.process.pid}: {engines}"
    return engines[0]


def protocol_pids(server: GeserveProcess) -> list[int]:
    """The processes serving HTTP and gRPC: the supervisor's protocol processes, or the server's own process when it
    runs alone."""
    if not server.multiprocess:
        return [server.process.pid]
    return sorted(pid for pid in children(server.process.pid) if multiprocess_role(pid) == "protocol")


def worker_pids(server: GeserveProcess) -> list[int]:
    """The children of the process that holds the models (see `engine_pid`): the model workers and multiprocessing's
    resource tracker."""
    return sorted(children(engine_pid(server)))


def server_pids(server: GeserveProcess) -> list[int]:
    """The server's own processes, not its workers: the one process, or the supervisor, the engine and the protocol
    processes."""
    if not server.multiprocess:
        return [server.process.pid]
    return [server.process.pid, engine_pid(server), *protocol_pids(server)]


def copy_model(name: str, repository: Path, new_name: str | None = None) -> Path:
    """Copy a shipped model into a test repository."""
    target = repository / (new_name or name)
    shutil.copytree(MODEL_REPOSITORY / name, target)
    return target


def config_text(
    name: str,
    *,
    backend: str = "",
    platform: str = "",
    max_batch_size: int = 0,
    inputs: Sequence[tuple[str, str, str]] = (),
    outputs: Sequence[tuple[str, str, str]] = (),
    extra: str = "",
) -> str:
    """A model's config.pbtxt (a `backend`, or else a `platform`). Each tensor is (name, data type, dims as
    config.pbtxt writes them: "-1", "2, 3"); `extra` is the rest of the config (batching, instances, parameters,
    warmup, ensemble steps) as text."""

    def tensors(declared: Sequence[tuple[str, str, str]]) -> str:
        return ", ".join(f'{{ name: "{n}" data_type: {dtype} dims: [ {dims} ] }}' for n, dtype, dims in declared)

    kind = f'backend: "{backend}"' if backend else f'platform: "{platform}"'
    return (
        f'name: "{name}"\n{kind}\nmax_batch_size: {max_batch_size}\n'
        f"input [ {tensors(inputs)} ]\noutput [ {tensors(outputs)} ]\n{extra}\n"
    )


def identity_config(
    name: str,
    dtype: str = "TYPE_FP32",
    dims: str = "-1",
    max_batch_size: int = 8,
    extra: str = "",
    delay_ms: int | str | None = None,
) -> str:
    """The config of an `identity` model: what comes in as INPUT0 goes out as OUTPUT0, after `delay_ms` in each
    execute where given (the backend's `execute_delay_ms`; one that is not a number fails the load)."""
    if delay_ms is not None:
        extra += f'\nparameters {{ key: "execute_delay_ms" value: {{ string_value: "{delay_ms}" }} }}'
    return config_text(
        name,
        backend="identity",
        max_batch_size=max_batch_size,
        inputs=[("INPUT0", dtype, dims)],
        outputs=[("OUTPUT0", dtype, dims)],
        extra=extra,
    )


def write_identity_model(
    repository: Path,
    name: str,
    dtype: str = "TYPE_FP32",
    dims: str = "-1",
    max_batch_size: int = 8,
    extra: str = "",
    versions: tuple[int, ...] = (1,),
    delay_ms: int | str | None = None,
) -> Path:
    """An `identity` model's folder (`identity_config`), with a folder for each of `versions`."""
    folder = repository / name
    folder.mkdir(parents=True, exist_ok=True)
    for version in versions:
        (folder / str(version)).mkdir(parents=True, exist_ok=True)
    config = identity_config(name, dtype, dims, max_batch_size, extra, delay_ms)
    (folder / "config.pbtxt").write_text(config)
    return folder


def write_sum_model(repository: Path) -> Path:
    """'sum': an ONNX Runtime model answering one number, the sum of a float vector of any length."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["X"], ["Y"], keepdims=1)],
        "sum",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    (repository / "sum" / "1").mkdir(parents=True)
    onnx.save(model, repository / "sum" / "1" / "model.onnx")
    (repository / "sum" / "config.pbtxt").write_text(
        'name: "sum"\nbackend: "onnxruntime"\nmax_batch_size: 0\n'
        'input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
    )
    return repository / "sum"


def write_python_model(repository: Path, name: str, model_py: str, config: str) -> Path:
    """A python-backend model's folder: its config and version 1's model.py."""
    folder = repository / name
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.py").write_text(model_py)
    (folder / "config.pbtxt").write_text(config)
    return folder


def start_echo(launch: Callable[..., GeserveProcess], repository: Path, *flags: str) -> GeserveProcess:
    """A server whose repository holds the identity model `echo` (FP32 [-1])."""
    write_identity_model(repository, "echo")
    return launch(f"--model-repository={repository}", *flags).wait_live()


def binary_infer_request(data: np.ndarray, model: str = "echo", extra_headers: str = "") -> tuple[bytes, bytes]:
    """The head and the body of an HTTP/1.1 infer request for `model` (input INPUT0, output OUTPUT0, FP32) with
    the binary tensor extension: `data`'s bytes after the JSON header, the output asked for as binary."""
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "INPUT0",
                    "shape": list(data.shape),
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": data.nbytes},
                }
            ],
            "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}],
        }
    ).encode()
    body = header + data.tobytes()
    head = (
        f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: geserve\r\nContent-Length: {len(body)}\r\n"
        f"Inference-Header-Content-Length: {len(header)}\r\n{extra_headers}\r\n"
    )
    return head.encode(), body


def run_on_threads(tasks: Sequence[Callable[[], object]], timeout_s: float = 120.0) -> None:
    """Every task on a thread of its own, all side by side; what any of them raised fails the caller, together."""
    failures: list[BaseException] = []

    def run(task: Callable[[], object]) -> None:
        try:
            task()
        except BaseException as error:  # reported below, with the others
            failures.append(error)

    threads = [threading.Thread(target=run, args=(task,)) for task in tasks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    assert not failures, failures


def connect_http(server: GeserveProcess) -> socket.socket:
    """A raw connection to the server's HTTP port."""
    sock = socket.create_connection(("127.0.0.1", server.http_port))
    sock.settimeout(15)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until its FIN; a reset fails the test here."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    sock.close()
    return received


class EchoLoad:
    """Threads sending JSON infers to an identity model `echo` (FP32 [-1]) over keep-alive connections,
    as most HTTP clients do, each value checked; outcomes counted: "ok", "wrong", "HTTP <status>",
    "refused" (at connect), or the exception's type (a reset, a connection closed without an answer)."""

    def __init__(self, server: GeserveProcess, threads: int = 4, pause_s: float = 0.0) -> None:
        self.server = server
        self.pause_s = pause_s
        self.outcomes: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(index,)) for index in range(threads)]

    def __enter__(self) -> EchoLoad:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def _run(self, index: int) -> None:
        connection: http.client.HTTPConnection | None = None
        sent = 0
        while not self._stop.is_set():
            values = [float(index), float(sent)]
            sent += 1
            body = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "FP32", "data": values}]})
            try:
                if connection is None:
                    connection = http.client.HTTPConnection("127.0.0.1", self.server.http_port, timeout=15)
                connection.request("POST", "/v2/models/echo/infer", body.encode())
                response = connection.getresponse()
                payload = response.read()
                if response.status != 200:
                    outcome = f"HTTP {response.status}"
                else:
                    outcome = "ok" if json.loads(payload)["outputs"][0]["data"] == values else "wrong"
                if response.getheader("connection", "").lower() == "close":
                    connection.close()
                    connection = None
            except ConnectionRefusedError:
                outcome, connection = "refused", None
                time.sleep(0.01)
            except (OSError, http.client.HTTPException) as error:  # resets, broken pipes, closed unanswered
                outcome = type(error).__name__
                if connection is not None:
                    connection.close()  # not left to the collector: an unclosed socket is a warning in a later test
                connection = None
            with self._lock:
                self.outcomes[outcome] += 1
            if self.pause_s:
                time.sleep(self.pause_s)
        if connection is not None:
            connection.close()
