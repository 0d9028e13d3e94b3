"""Two protocol processes in front of one engine (--frontend-processes=2), whatever mode the rest of the suite runs:
state shared across connections, a protocol process or the engine killed, and a drained shutdown."""

from __future__ import annotations

import collections
import contextlib
import os
import re
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as client_shm
from tritonclient.utils import InferenceServerException

from tests.e2e.test_metrics import metric, scrape
from tests.e2e.test_sequences import STEPS, check, grpc_step, http_step, value_of
from tests.support import (
    EchoLoad,
    GeserveProcess,
    alive,
    copy_model,
    descendants,
    engine_pid,
    http_status,
    protocol_pids,
    segments_of_server,
    start_echo,
    wait_until,
    worker_pids,
    write_identity_model,
)

pytestmark = [pytest.mark.e2e, pytest.mark.one_layout]
Launch = Callable[..., GeserveProcess]
TWO = "--frontend-processes=2"
# Fresh connections per check: at least this many, more (up to MOST) until both protocol processes served one.
FRESH = 8
MOST = 32
# A channel of its own: gRPC shares one TCP connection between the channels of a process to the same target.
OWN_CHANNEL = [("grpc.use_local_subchannel_pool", 1)]
PROTOCOLS = ("http", "grpc")


# -- which protocol process serves a connection --------------------------------------------------------------


def server_connections(server: GeserveProcess) -> dict[int, int]:
    """The established connections to the server's HTTP and gRPC ports: socket inode -> the protocol process
    holding it (read from /proc/net/tcp{,6} and the protocol processes' descriptors)."""
    ports = {server.http_port, server.grpc_port}
    inodes: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                established = fields[3] == "01"
                if established and int(fields[1].rsplit(":", 1)[1], 16) in ports:
                    inodes.add(int(fields[9]))
    owners: dict[int, int] = {}
    for pid in protocol_pids(server):
        with contextlib.suppress(OSError):
            for descriptor in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(descriptor)
                    if target.startswith("socket:[") and int(target[8:-1]) in inodes:
                        owners[int(target[8:-1])] = pid
    return owners


def fresh_client(server: GeserveProcess, protocol: str) -> Any:
    """A tritonclient client (http or grpc) that opens a connection of its own at its first call."""
    if protocol == "http":
        return httpclient.InferenceServerClient(server.url, network_timeout=30)
    return grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}", channel_args=OWN_CHANNEL)


class Fresh:
    """A tritonclient client (http or grpc) on a connection of its own, opened by its first call; `process()` says
    which protocol process serves it. Opened one at a time: the connection is the one that appeared meanwhile."""

    def __init__(self, server: GeserveProcess, protocol: str) -> None:
        self.server = server
        self.protocol = protocol
        self.module: Any = httpclient if protocol == "http" else grpcclient
        self._before = set(server_connections(server))
        self._process: int | None = None
        self.client = fresh_client(server, protocol)

    def process(self) -> int:
        """Asked first before another connection opens (then remembered)."""
        if self._process is None:
            new = {pid for inode, pid in server_connections(self.server).items() if inode not in self._before}
            assert len(new) == 1, f"{self.protocol}: the connections that appeared are held by {new}"
            self._process = new.pop()
        return self._process

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> Fresh:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def rounds(done: Callable[[], bool]) -> Iterator[int]:
    """Round numbers: FRESH of them, then more until `done()` (MOST at most)."""
    for number in range(MOST):
        if number >= FRESH and done():
            return
        yield number


def both(server: GeserveProcess, served: set[int]) -> bool:
    return served == set(protocol_pids(server))


def assert_both_served(server: GeserveProcess, served: set[int]) -> None:
    assert both(server, served), f"served by {served} of {protocol_pids(server)}: one was never used"


# -- what the models answer ---------------------------------------------------------------------------------


def simple_inputs(module: Any, left: np.ndarray, right: np.ndarray) -> list[Any]:
    inputs = [module.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
    inputs[0].set_data_from_numpy(left)
    inputs[1].set_data_from_numpy(right)
    return inputs


def infer_simple(fresh: Fresh, number: int) -> None:
    """simple (OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1) with values of round `number`, checked."""
    left = np.arange(16, dtype=np.int32).reshape(1, 16) + number
    right = np.full((1, 16), 3, dtype=np.int32)
    result = fresh.client.infer("simple", simple_inputs(fresh.module, left, right))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), left + right)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), left - right)


def other(protocol: str) -> str:
    return "grpc" if protocol == "http" else "http"


@pytest.fixture
def simple_repository(tmp_path: Path) -> Path:
    repository = tmp_path / "models"
    copy_model("simple", repository)
    return repository


# -- state kept in the engine, reached through either process -------------------------------------------------


def test_a_region_registered_on_one_connection_serves_a_request_on_another(
    launch: Launch, simple_repository: Path
) -> None:
    server = launch(f"--model-repository={simple_repository}", "--allow-client-shm=true", TWO).wait_live()
    key = f"/geserve-test-{uuid.uuid4().hex}"
    handle = client_shm.create_shared_memory_region(key.strip("/"), key, 256)  # inputs at 0, outputs at 128
    crossed: list[int] = []  # rounds whose registering and inferring connections different processes served
    served: set[int] = set()
    try:
        for number in rounds(lambda: bool(crossed) and both(server, served)):
            registering = PROTOCOLS[number % 2]
            left = np.arange(16, dtype=np.int32) + number
            right = np.full(16, number, dtype=np.int32)
            client_shm.set_shared_memory_region(handle, [left, right])
            region = f"region_{number}"
            with Fresh(server, registering) as register:
                register.client.register_system_shared_memory(region, key, 256)
                served.add(register.process())
                with Fresh(server, other(registering)) as infer:
                    inputs = [infer.module.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
                    outputs = [infer.module.InferRequestedOutput(name) for name in ("OUTPUT0", "OUTPUT1")]
                    for index, tensor in enumerate(inputs):
                        tensor.set_shared_memory(region, 64, offset=64 * index)
                    for index, output in enumerate(outputs):
                        output.set_shared_memory(region, 64, offset=128 + 64 * index)
                    infer.client.infer("simple", inputs, outputs=outputs)
                    served.add(infer.process())
                    if register.process() != infer.process():
                        crossed.append(number)
                sums, differences = client_shm.get_contents_as_numpy(handle, np.int32, [2, 16], offset=128)
                np.testing.assert_array_equal(sums, left + right)
                np.testing.assert_array_equal(differences, left - right)
            with Fresh(server, other(registering)) as unregister:  # on yet another connection
                unregister.client.unregister_system_shared_memory(region)
            with Fresh(server, registering) as status:
                assert region not in registered_regions(status), number
    finally:
        client_shm.destroy_shared_memory_region(handle)
    assert crossed, "no region was ever used through the other process: the test proved nothing"
    assert_both_served(server, served)
    assert server.stop() == 0


def registered_regions(fresh: Fresh) -> list[str]:
    if fresh.protocol == "http":
        return [region["name"] for region in fresh.client.get_system_shared_memory_status()]
    return list(fresh.client.get_system_shared_memory_status(as_json=True).get("regions", {}))


def test_a_model_loaded_through_one_connection_is_served_and_unloaded_through_all(
    launch: Launch, simple_repository: Path
) -> None:
    server = launch(f"--model-repository={simple_repository}", "--model-control-mode=explicit", TWO).wait_live()
    with Fresh(server, "http") as control:
        control.client.load_model("simple")
    served: set[int] = set()  # both: the process that did not load the model serves it too
    for number in rounds(lambda: both(server, served)):
        with Fresh(server, PROTOCOLS[number % 2]) as fresh:
            assert fresh.client.is_model_ready("simple")
            infer_simple(fresh, number)
            served.add(fresh.process())
    assert_both_served(server, served)
    with Fresh(server, "grpc") as control:
        control.client.unload_model("simple")
    refusals: collections.Counter[tuple[str, str, str]] = collections.Counter()
    for number in range(FRESH):
        with Fresh(server, PROTOCOLS[number % 2]) as fresh:
            assert not fresh.client.is_model_ready("simple")
            with pytest.raises(InferenceServerException) as error:
                infer_simple(fresh, number)
            refusals[(fresh.protocol, str(error.value.status()), error.value.message())] += 1
    assert set(refusals) == {
        ("http", "404", "Request for unknown model: 'simple' has no available versions"),
        ("grpc", "StatusCode.NOT_FOUND", "Request for unknown model: 'simple' has no available versions"),
    }, refusals
    with Fresh(server, "http") as control:  # and it loads again
        control.client.load_model("simple")
        infer_simple(control, 1)
    assert server.stop() == 0


def test_a_sequence_whose_every_request_arrives_on_a_fresh_connection(launch: Launch, tmp_path: Path) -> None:
    repository = tmp_path / "models"
    copy_model("sequence_accumulator", repository)
    server = launch(f"--model-repository={repository}", TWO).wait_live()
    model = "sequence_accumulator"
    served: set[int] = set()
    sequences = (11, 12, 13)  # side by side: one step of each in turn
    for step in range(STEPS):
        for number, sequence_id in enumerate(sequences, start=1):
            values = [value_of(number, i) for i in range(STEPS)]
            protocol = PROTOCOLS[(step + number) % 2]
            with Fresh(server, protocol) as fresh:
                run_step = http_step if protocol == "http" else grpc_step
                outputs = run_step(
                    fresh.client, model, sequence_id, values[step], start=step == 0, end=step == STEPS - 1
                )
                check(model, outputs, sequence_id, values, step)
                served.add(fresh.process())
    assert_both_served(server, served)
    assert server.stop() == 0


def test_statistics_and_metrics_count_every_request_of_every_connection(
    launch: Launch, simple_repository: Path
) -> None:
    server = launch(f"--model-repository={simple_repository}", TWO).wait_live()
    served: set[int] = set()
    sent = collections.Counter[str]()
    for number in rounds(lambda: both(server, served)):
        with Fresh(server, PROTOCOLS[number % 2]) as fresh:
            infer_simple(fresh, number)
            sent[fresh.protocol] += 1
            served.add(fresh.process())
    assert_both_served(server, served)
    assert sent["http"] >= FRESH // 2 and sent["grpc"] >= FRESH // 2
    total = sum(sent.values())
    readers: set[int] = set()
    for number in rounds(lambda: both(server, readers)):  # every process answers the same numbers
        with Fresh(server, PROTOCOLS[number % 2]) as fresh:
            if fresh.protocol == "http":
                stats = fresh.client.get_inference_statistics("simple")["model_stats"][0]
            else:
                stats = fresh.client.get_inference_statistics("simple", as_json=True)["model_stats"][0]
            assert int(stats["inference_count"]) == total, stats
            assert int(stats["inference_stats"]["success"]["count"]) == total, stats
            readers.add(fresh.process())
    text = scrape(server)
    assert metric(text, "nv_inference_request_success", "simple") == total
    assert metric(text, "nv_inference_count", "simple") == total
    assert server.stop() == 0


# -- processes that die, a server that stops ------------------------------------------------------------------


RESTARTED = re.compile(r"protocol process (\d+) \(pid (\d+)\) exited with status (-?\d+); restarting")
STARTED = re.compile(r"started protocol process (\d+) \(pid (\d+)\)")


def test_a_killed_protocol_process_is_replaced_and_the_server_keeps_answering(launch: Launch, repository: Path) -> None:
    server = start_echo(launch, repository, TWO)
    first = protocol_pids(server)
    assert len(first) == 2
    victim = first[0]
    with EchoLoad(server, threads=6) as load:
        wait_until(lambda: load.outcomes["ok"] > 50)
        os.kill(victim, signal.SIGKILL)
        assert wait_until(lambda: len(protocol_pids(server)) == 2 and victim not in protocol_pids(server)), (
            protocol_pids(server)
        )
        answered_across = load.outcomes["ok"]
        wait_until(lambda: load.outcomes["ok"] > answered_across + 50)
    assert server.process.poll() is None, server.log()
    # Requests on the killed process's connections are lost with it (a reset, closed unanswered); none is
    # answered wrongly or with an error.
    assert not {outcome for outcome in load.outcomes if outcome == "wrong" or outcome.startswith("HTTP ")}, (
        load.outcomes
    )
    assert load.outcomes["ok"] > answered_across + 50, load.outcomes
    restarts = RESTARTED.findall(server.log())
    assert [int(pid) for _, pid, _ in restarts] == [victim], server.log()
    (replacement,) = set(protocol_pids(server)) - set(first)
    assert (restarts[0][0], str(replacement)) in STARTED.findall(server.log()), server.log()
    served: set[int] = set()
    for number in rounds(lambda: both(server, served)):  # the new process serves too, and nothing fails
        with Fresh(server, PROTOCOLS[number % 2]) as fresh:
            data = np.array([[float(number), 2.0]], dtype=np.float32)
            tensor = fresh.module.InferInput("INPUT0", [1, 2], "FP32")
            tensor.set_data_from_numpy(data)
            np.testing.assert_array_equal(fresh.client.infer("echo", [tensor]).as_numpy("OUTPUT0"), data)
            served.add(fresh.process())
    assert replacement in served
    with EchoLoad(server, threads=4) as after:
        wait_until(lambda: after.outcomes["ok"] > 100)
    assert set(after.outcomes) == {"ok"}, after.outcomes
    pid = server.process.pid
    assert server.stop() == 0, server.log()
    assert not segments_of_server(pid)


def test_a_protocol_process_whose_loop_stops_answering_is_killed_and_replaced(launch: Launch, repository: Path) -> None:
    """The supervisor pings each protocol process's event loop; one that stops answering (here: stopped with
    SIGSTOP, as a loop stuck in a request would be) is killed and replaced, and the server keeps answering."""
    server = start_echo(launch, repository, TWO, "--protocol-healthcheck-secs=2")
    # Only a process that said it is ready is pinged: the supervisor announces the services once both have.
    assert wait_until(lambda: "(2 protocol processes)" in server.log(), 30), server.log()
    first = protocol_pids(server)
    victim = first[0]
    os.kill(victim, signal.SIGSTOP)
    try:
        assert wait_until(lambda: victim not in protocol_pids(server) and len(protocol_pids(server)) == 2, 30), (
            server.log()
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGCONT)
    assert re.search(
        rf"protocol process \d \(pid {victim}\) has not answered for 2 s: its event loop is stuck", server.log()
    )
    assert [int(pid) for _, pid, _ in RESTARTED.findall(server.log())] == [victim], server.log()
    # The other process, alive all along, was never taken for stuck: answering is all a ping asks.
    time.sleep(3)
    assert first[1] in protocol_pids(server) and server.log().count("has not answered") == 1, server.log()
    with EchoLoad(server, threads=4) as after:
        wait_until(lambda: after.outcomes["ok"] > 100)
    assert set(after.outcomes) == {"ok"}, after.outcomes
    assert server.stop() == 0, server.log()


def test_without_a_healthcheck_a_stopped_protocol_process_is_left_alone(launch: Launch, repository: Path) -> None:
    server = start_echo(launch, repository, TWO, "--protocol-healthcheck-secs=0")
    victim = protocol_pids(server)[0]
    os.kill(victim, signal.SIGSTOP)
    try:
        time.sleep(3)
        assert victim in protocol_pids(server) and "has not answered" not in server.log()
    finally:
        os.kill(victim, signal.SIGCONT)
    assert server.stop() == 0, server.log()


def test_a_killed_engine_stops_the_server_with_nothing_left(launch: Launch, simple_repository: Path) -> None:
    server = launch(f"--model-repository={simple_repository}", TWO).wait_live()
    pid = server.process.pid
    engine = engine_pid(server)
    tree = descendants(pid)
    assert len(tree) >= 5, tree  # the engine, its workers and resource tracker, two protocol processes
    assert segments_of_server(pid), "the run made no segments: the test proves nothing"
    os.kill(engine, signal.SIGKILL)
    assert server.wait_exit(60) == 1, server.log()
    assert re.search(rf"the engine \(pid {engine}\) exited with status -9; stopping the server", server.log())
    assert not segments_of_server(pid), sorted(segments_of_server(pid))
    assert wait_until(lambda: not any(alive(process) for process in tree), 10), [p for p in tree if alive(p)]


def test_sigterm_to_the_process_group_drains_with_no_failed_request(launch: Launch, repository: Path) -> None:
    """As a container runtime or a terminal's Ctrl-C does: every process gets the signal, only the supervisor acts."""
    drain_s = 2
    write_identity_model(repository, "echo")
    server = launch(f"--model-repository={repository}", TWO, f"--drain-delay-secs={drain_s}", new_session=True)
    server.wait_live()
    outcomes: collections.Counter[str] = collections.Counter()
    stop = threading.Event()

    def fresh_connections(protocol: str) -> None:
        """A checked request on a connection of its own, again and again, until told to stop."""
        sent = 0
        while not stop.is_set():
            sent += 1
            data = np.array([[float(sent), 3.0]], dtype=np.float32)
            module = httpclient if protocol == "http" else grpcclient
            try:
                with contextlib.closing(fresh_client(server, protocol)) as client:
                    tensor = module.InferInput("INPUT0", [1, 2], "FP32")
                    tensor.set_data_from_numpy(data)
                    same = np.array_equal(client.infer("echo", [tensor]).as_numpy("OUTPUT0"), data)
                    outcomes[f"{protocol} {'ok' if same else 'wrong'}"] += 1
            except Exception as error:  # counted, and the assertion below shows it
                outcomes[f"{protocol} {str(error)[:120]}"] += 1

    threads = [threading.Thread(target=fresh_connections, args=(protocol,)) for protocol in (*PROTOCOLS, *PROTOCOLS)]
    with EchoLoad(server, threads=4, pause_s=0.005) as load:
        for thread in threads:
            thread.start()
        wait_until(lambda: load.outcomes["ok"] > 50 and len(outcomes) >= 2)
        os.killpg(server.process.pid, signal.SIGTERM)
        time.sleep(0.5)
        ready_while_draining = http_status(f"http://{server.url}/v2/health/ready")
        time.sleep(drain_s - 1.0)  # traffic keeps arriving for most of the window
        stop.set()
        for thread in threads:
            thread.join()
    pid = server.process.pid
    assert server.wait_exit(60) == 0, server.log()
    assert ready_while_draining != 200
    assert set(load.outcomes) == {"ok"}, load.outcomes
    assert set(outcomes) == {"http ok", "grpc ok"}, outcomes
    assert "did not finish in time" not in server.log() and "Traceback" not in server.log()
    assert not segments_of_server(pid)


def test_the_process_tree_is_a_supervisor_an_engine_and_two_protocol_processes(
    launch: Launch, simple_repository: Path
) -> None:
    server = launch(f"--model-repository={simple_repository}", TWO).wait_live()
    listing = subprocess.run(
        ["ps", "-e", "-ww", "-o", "pid=,ppid=,comm=,args="], capture_output=True, text=True, check=True
    ).stdout
    tree: dict[int, list[tuple[int, str]]] = collections.defaultdict(list)
    names: dict[int, str] = {}
    for line in listing.splitlines():
        pid, ppid, name, args = line.split(None, 3)
        tree[int(ppid)].append((int(pid), args))
        names[int(pid)] = name
    below = tree[server.process.pid]
    engines = [pid for pid, _ in below if names[pid] == "geserve-engine"]
    protocols = [pid for pid, _ in below if names[pid] in ("geserve-proto0", "geserve-proto1")]
    assert len(engines) == 1 and len(protocols) == 2 and len(below) == 3, {pid: names[pid] for pid, _ in below}
    assert {names[pid] for pid in protocols} == {"geserve-proto0", "geserve-proto1"}
    assert engines == [engine_pid(server)] and sorted(protocols) == protocol_pids(server)
    # The workers are the engine's; a protocol process starts none (at most multiprocessing's resource tracker,
    # which its shared arena may start).
    assert {pid for pid, _ in tree[engines[0]]} == set(worker_pids(server))
    assert any("spawn_main" in args for _, args in tree[engines[0]]), tree[engines[0]]
    for pid in protocols:
        assert all("resource_tracker" in args for _, args in tree[pid]), tree[pid]
    with Fresh(server, "http") as fresh:
        infer_simple(fresh, 0)
    assert server.stop() == 0


def mapped_segments(pid: int) -> set[str]:
    """The /dev/shm files process `pid` has mapped now."""
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {line.split("/dev/shm/", 1)[1].removesuffix(" (deleted)") for line in lines if "/dev/shm/" in line}


def test_request_bytes_go_from_the_protocol_processes_to_the_workers_and_never_through_the_engine(
    launch: Launch, repository: Path
) -> None:
    """The engine schedules descriptors: it never maps a request arena, yet every request is served with its own
    values, the workers reading the inputs where the protocol processes put them."""
    write_identity_model(repository, "identity", max_batch_size=8, extra="dynamic_batching { }")
    server = launch(f"--model-repository={repository}", TWO).wait_live()
    rows = 1 << 14  # 64 KiB a request: well past anything a frame would carry inline
    for protocol in PROTOCOLS:
        served: set[int] = set()
        for number in rounds(lambda: both(server, served)):  # noqa: B023 (read while `served` is this protocol's)
            with Fresh(server, protocol) as fresh:
                values = np.random.default_rng(number).standard_normal((1, rows)).astype(np.float32)
                given = fresh.module.InferInput("INPUT0", [1, rows], "FP32")
                given.set_data_from_numpy(values)
                result = fresh.client.infer("identity", [given])
                np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), values)
                served.add(fresh.process())
        assert both(server, served), f"{protocol}: served by {served} only"
    arenas = {name for name in segments_of_server(server.process.pid) if "_requests" in name}
    assert len(arenas) == 2, arenas  # one per protocol process
    for pid in protocol_pids(server):
        assert mapped_segments(pid) & arenas, f"protocol process {pid} maps no request arena"
    assert not mapped_segments(engine_pid(server)) & arenas, "the engine mapped a request arena"
    read_by_workers = set().union(*(mapped_segments(pid) for pid in worker_pids(server) if alive(pid)))
    assert read_by_workers & arenas, "no worker read an input where it lay"
    assert server.stop() == 0
