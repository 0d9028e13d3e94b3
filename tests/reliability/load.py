"""Checked traffic for the soak and chaos runs: request kinds, outcome tallies and process samples."""

from __future__ import annotations

import contextlib
import http.client
import os
import queue
import random
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.support import MODEL_REPOSITORY, GeserveProcess, segments_of_server, server_pids, worker_pids

PYTHON_MODELS = Path(__file__).resolve().parents[1] / "python_models"

_REQUEST_ID = re.compile(r"\[request id: [^\]]*\] ")
# gRPC statuses and texts that mean the call never reached an answer from the server.
_TRANSPORT_TEXTS = ("Socket closed", "failed to connect", "Connection reset", "Broken pipe", "connection refused")


class WrongAnswerError(AssertionError):
    """A response arrived but its values are not the ones the request asked for."""


def build_repository(root: Path) -> Path:
    """The soak and chaos models: ONNX (batched, BYTES), python (plain, dynamic-batched, decoupled)."""
    repository = root / "models"
    shutil.rmtree(repository, ignore_errors=True)
    repository.mkdir(parents=True)
    for name in ("simple", "simple_string", "repeat_int32"):
        shutil.copytree(MODEL_REPOSITORY / name, repository / name)
    for name in ("add_sub", "batched_rows"):
        shutil.copytree(PYTHON_MODELS / name, repository / name, ignore=shutil.ignore_patterns("__pycache__"))
    with (repository / "simple" / "config.pbtxt").open("a") as config:
        config.write("\ndynamic_batching { max_queue_delay_microseconds: 500 }\n")
    return repository


# -- outcomes ---------------------------------------------------------------------------------


@dataclass
class Counts:
    sent: int = 0
    ok: int = 0
    failed: int = 0  # the server answered with an error
    wrong: int = 0  # the server answered with values that do not match the request
    lost: int = 0  # no answer: reset, closed without a response, timed out
    refused: int = 0  # the connection was refused (a server that is stopping or gone)
    errors: dict[str, int] = field(default_factory=dict)


class Tally:
    """Thread-safe counts per request kind, with the distinct error texts seen (truncated)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.kinds: dict[str, Counts] = {}

    def record(self, kind: str, outcome: str, detail: str = "") -> None:
        with self._lock:
            counts = self.kinds.setdefault(kind, Counts())
            counts.sent += 1
            setattr(counts, outcome, getattr(counts, outcome) + 1)
            if detail:
                key = f"{outcome}: {_REQUEST_ID.sub('', detail)[:160]}"
                counts.errors[key] = counts.errors.get(key, 0) + 1

    def merge(self, other: Tally) -> None:
        """Add another tally's counts (error texts included) to this one."""
        with self._lock:
            for kind, theirs in other.kinds.items():
                mine = self.kinds.setdefault(kind, Counts())
                for outcome in ("sent", "ok", "failed", "wrong", "lost", "refused"):
                    setattr(mine, outcome, getattr(mine, outcome) + getattr(theirs, outcome))
                for text, count in theirs.errors.items():
                    mine.errors[text] = mine.errors.get(text, 0) + count

    def total(self, outcome: str) -> int:
        with self._lock:
            return sum(getattr(counts, outcome) for counts in self.kinds.values())

    def as_json(self) -> dict[str, Any]:
        with self._lock:
            return {kind: vars(counts) | {"errors": dict(counts.errors)} for kind, counts in sorted(self.kinds.items())}


def classify(error: BaseException) -> tuple[str, str]:
    """(outcome, detail) for an exception raised by one request."""
    if isinstance(error, WrongAnswerError):
        return "wrong", str(error)
    if isinstance(error, ConnectionRefusedError):
        return "refused", "connection refused"
    if isinstance(error, InferenceServerException):
        text = error.message() or ""
        status = str(error.status() or "")
        # Only a call-level status can mean "never answered"; an error the server sent inside a stream has none.
        transport = "UNAVAILABLE" in status and any(part in text for part in _TRANSPORT_TEXTS)
        if "DEADLINE_EXCEEDED" in status or transport:
            return ("refused" if "failed to connect" in text or "refused" in text else "lost"), f"{status} {text}"
        return "failed", f"{status} {text}".strip()
    if isinstance(error, OSError | http.client.HTTPException | TimeoutError | queue.Empty):
        return "lost", f"{type(error).__name__}: {error}"
    return "lost", f"{type(error).__name__}: {error}"


# -- request kinds ----------------------------------------------------------------------------


def _expect(condition: bool, what: str) -> None:
    if not condition:
        raise WrongAnswerError(what)


def http_binary_simple(client: httpclient.InferenceServerClient, rng: random.Random) -> None:
    rows = rng.randint(1, 4)
    a = np.array([[rng.randint(-1000, 1000) for _ in range(16)] for _ in range(rows)], dtype=np.int32)
    b = np.array([[rng.randint(-1000, 1000) for _ in range(16)] for _ in range(rows)], dtype=np.int32)
    inputs = [httpclient.InferInput(name, [rows, 16], "INT32") for name in ("INPUT0", "INPUT1")]
    inputs[0].set_data_from_numpy(a, binary_data=True)
    inputs[1].set_data_from_numpy(b, binary_data=True)
    outputs = [httpclient.InferRequestedOutput(name, binary_data=True) for name in ("OUTPUT0", "OUTPUT1")]
    result = client.infer("simple", inputs, outputs=outputs, request_id=str(rng.random()))
    _expect(np.array_equal(result.as_numpy("OUTPUT0"), a + b), "simple OUTPUT0 != INPUT0 + INPUT1")
    _expect(np.array_equal(result.as_numpy("OUTPUT1"), a - b), "simple OUTPUT1 != INPUT0 - INPUT1")


def http_json_add_sub(client: httpclient.InferenceServerClient, rng: random.Random) -> None:
    a = np.array([rng.uniform(-10, 10) for _ in range(4)], dtype=np.float32)
    b = np.array([rng.uniform(-10, 10) for _ in range(4)], dtype=np.float32)
    inputs = [httpclient.InferInput(name, [4], "FP32") for name in ("INPUT0", "INPUT1")]
    inputs[0].set_data_from_numpy(a, binary_data=False)
    inputs[1].set_data_from_numpy(b, binary_data=False)
    outputs = [httpclient.InferRequestedOutput(name, binary_data=False) for name in ("OUTPUT0", "OUTPUT1")]
    result = client.infer("add_sub", inputs, outputs=outputs)
    _expect(np.allclose(result.as_numpy("OUTPUT0"), a + b, atol=1e-5), "add_sub OUTPUT0 != INPUT0 + INPUT1")
    _expect(np.allclose(result.as_numpy("OUTPUT1"), a - b, atol=1e-5), "add_sub OUTPUT1 != INPUT0 - INPUT1")


def grpc_unary_batched(client: grpcclient.InferenceServerClient, rng: random.Random) -> None:
    if rng.random() < 0.5:
        x = np.array([[rng.uniform(0, 100), rng.uniform(0, 100)]], dtype=np.float32)
        tensor = grpcclient.InferInput("X", [1, 2], "FP32")
        tensor.set_data_from_numpy(x)
        result = client.infer("batched_rows", [tensor])
        _expect(np.allclose(result.as_numpy("Y"), x * 10), "batched_rows Y != 10 X")
        return
    a = [rng.randint(-99, 99) for _ in range(16)]
    b = [rng.randint(-99, 99) for _ in range(16)]
    inputs = []
    for name, values in (("INPUT0", a), ("INPUT1", b)):
        tensor = grpcclient.InferInput(name, [1, 16], "BYTES")
        tensor.set_data_from_numpy(np.array([[str(v).encode() for v in values]], dtype=object))
        inputs.append(tensor)
    result = client.infer("simple_string", inputs)
    sums = [int(v) for v in result.as_numpy("OUTPUT0").reshape(-1)]
    _expect(sums == [x + y for x, y in zip(a, b, strict=True)], "simple_string OUTPUT0 != INPUT0 + INPUT1")


class Streamer:
    """One gRPC stream per thread on the decoupled repeat_int32: n values in, n responses and a final out."""

    def __init__(self, client: grpcclient.InferenceServerClient) -> None:
        self.client = client
        self.received: queue.Queue[Any] = queue.Queue()
        client.start_stream(callback=lambda result, error: self.received.put(error if error is not None else result))

    def __call__(self, _: Any, rng: random.Random) -> None:
        values = np.array([rng.randint(-5000, 5000) for _ in range(rng.randint(1, 6))], dtype=np.int32)
        inputs = [
            grpcclient.InferInput("IN", [len(values)], "INT32"),
            grpcclient.InferInput("DELAY", [len(values)], "UINT32"),
            grpcclient.InferInput("WAIT", [1], "UINT32"),
        ]
        inputs[0].set_data_from_numpy(values)
        inputs[1].set_data_from_numpy(np.zeros(len(values), dtype=np.uint32))
        inputs[2].set_data_from_numpy(np.zeros(1, dtype=np.uint32))
        request_id = f"{rng.getrandbits(48):x}"
        try:
            self.client.async_stream_infer(
                "repeat_int32", inputs, request_id=request_id, enable_empty_final_response=True
            )
        except InferenceServerException:
            # The stream already ended; what ended it went to the callback: report that instead.
            with contextlib.suppress(queue.Empty):
                item = self.received.get(timeout=5)
                if isinstance(item, BaseException):
                    raise item from None
            raise
        got: list[int] = []
        while True:
            item = self.received.get(timeout=30)
            if isinstance(item, BaseException):
                raise item
            response = item.get_response()
            _expect(response.id == request_id, f"stream answer for '{response.id}' while waiting for '{request_id}'")
            if response.parameters["triton_final_response"].bool_param:
                break
            got.append(int(item.as_numpy("OUT")[0]))
        _expect(got == values.tolist(), "repeat_int32 responses differ from IN")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.stop_stream()


# -- running traffic --------------------------------------------------------------------------


@dataclass(frozen=True)
class Kind:
    """A request kind: how many threads send it, and how each thread makes its client and its request."""

    name: str
    threads: int
    client: Callable[[GeserveProcess], Any]
    request: Callable[[Any, Any, random.Random], None]


def _http_client(server: GeserveProcess) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.url, network_timeout=30, connection_timeout=5)


def _grpc_client(server: GeserveProcess) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")


def _call(function: Callable[[Any, random.Random], None]) -> Callable[[Any, Any, random.Random], None]:
    return lambda client, _state, rng: function(client, rng)


def _stream(client: Any, state: Any, rng: random.Random) -> None:
    state(client, rng)


MIXED = (
    Kind("HTTP binary / simple (ONNX, batched)", 3, _http_client, _call(http_binary_simple)),
    Kind("HTTP JSON / add_sub (python)", 2, _http_client, _call(http_json_add_sub)),
    Kind(
        "gRPC unary / batched_rows (python, batched) + simple_string (BYTES)",
        3,
        _grpc_client,
        _call(grpc_unary_batched),
    ),
    Kind("gRPC stream / repeat_int32 (decoupled)", 2, _grpc_client, _stream),
)


class Traffic:
    """Threads sending checked requests until stopped; bursty, so concurrency keeps changing."""

    def __init__(self, server: GeserveProcess, kinds: tuple[Kind, ...] = MIXED, bursty: bool = True) -> None:
        self.server = server
        self.kinds = kinds
        self.bursty = bursty
        self.tally = Tally()
        self.stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(kind, index), daemon=True, name=f"load-{kind.name}-{index}")
            for kind in kinds
            for index in range(kind.threads)
        ]

    def __enter__(self) -> Traffic:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.finish()

    def finish(self, timeout_s: float = 60.0) -> None:
        self.stop.set()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(deadline - time.monotonic(), 0.1))

    def _run(self, kind: Kind, index: int) -> None:
        rng = random.Random(f"{kind.name}-{index}")
        client = state = None
        while not self.stop.is_set():
            if self.bursty and rng.random() < 0.02:
                time.sleep(rng.uniform(0.05, 1.0))  # this thread pauses: concurrency dips and recovers
            try:
                if client is None:
                    client = kind.client(self.server)
                    state = Streamer(client) if kind.request is _stream else None
                kind.request(client, state, rng)
                self.tally.record(kind.name, "ok")
            except BaseException as error:  # every outcome is counted, none ends the thread
                outcome, detail = classify(error)
                self.tally.record(kind.name, outcome, detail)
                if outcome in ("lost", "refused") or isinstance(state, Streamer):
                    _close(client, state)  # a fresh connection (and stream) for the next request
                    client = state = None
                    time.sleep(0.05)
        _close(client, state)


def _close(client: Any, state: Any) -> None:
    if isinstance(state, Streamer):
        state.close()
    if client is not None:
        with contextlib.suppress(Exception):
            client.close()


# -- process samples --------------------------------------------------------------------------


def _rss_mib(pid: int) -> float:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def sample(server: GeserveProcess, started: float, tally: Tally) -> dict[str, Any]:
    """One reading of the server: front-end and worker RSS, descriptors, segments, requests so far. The front-end is
    the server's own processes together (one, or the supervisor, the engine and the protocol processes)."""
    frontend = server_pids(server)
    workers = worker_pids(server)
    return {
        "t_s": round(time.monotonic() - started, 1),
        "requests": tally.total("sent"),
        "frontend_rss_mib": round(sum(_rss_mib(pid) for pid in frontend), 1),
        "workers_rss_mib": round(sum(_rss_mib(worker) for worker in workers), 1),
        "workers": len(workers),
        "frontend_fds": sum(_fds(pid) for pid in frontend),
        "workers_fds": sum(_fds(worker) for worker in workers),
        # Its own: another server's on the machine do not count.
        "shm_segments": len(segments_of_server(server.process.pid)),
    }
