"""System shared memory through tritonclient's own shm utilities: off by default, bounds-checked when on."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException, serialize_byte_tensor

from tests.e2e.test_perf_analyzer import run_briefly
from tests.support import GeserveProcess, copy_model, server_pids, worker_pids, write_sum_model

GIB = 1 << 30

pytestmark = pytest.mark.e2e

Launch = Callable[..., GeserveProcess]
DISABLED = "Client shared memory is disabled. Start the server with '--allow-client-shm=true' to enable."


@pytest.fixture
def regions() -> Iterator[Callable[[int], tuple[str, Any]]]:
    """Create client regions with unique keys; every one is destroyed at teardown."""
    handles: list[Any] = []

    def create(size: int) -> tuple[str, Any]:
        key = f"/geserve-test-{uuid.uuid4().hex}"
        handle = shm.create_shared_memory_region(key.strip("/"), key, size)
        handles.append(handle)
        return key, handle

    yield create
    for handle in handles:
        with contextlib.suppress(FileNotFoundError):  # a test removed the segment itself
            shm.destroy_shared_memory_region(handle)


@pytest.fixture(scope="module")
def shm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GeserveProcess]:
    root = tmp_path_factory.mktemp("shm")
    repository = root / "models"
    for name in ("simple", "simple_string"):
        copy_model(name, repository)
    write_sum_model(repository)
    process = GeserveProcess(root / "geserve.log", f"--model-repository={repository}", "--allow-client-shm=true")
    yield process.wait_live()
    assert process.stop() == 0, process.log()


def _good_request(server: GeserveProcess) -> None:
    data = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [httpclient.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
    for tensor in inputs:
        tensor.set_data_from_numpy(data)
    result = httpclient.InferenceServerClient(server.url).infer("simple", inputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data * 2)


def test_off_by_default_with_tritons_message(launch: Launch, tmp_path: Any, regions: Any) -> None:
    repository = tmp_path / "models"
    copy_model("simple", repository)
    server = launch(f"--model-repository={repository}").wait_live()
    key, _ = regions(64)
    http = httpclient.InferenceServerClient(server.url)
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    for call in (lambda: http.register_system_shared_memory("r", key, 64), http.unregister_system_shared_memory):
        with pytest.raises(InferenceServerException) as error:
            call()
        assert error.value.message() == DISABLED
    with pytest.raises(InferenceServerException) as error:
        grpc.register_system_shared_memory("r", key, 64)
    assert error.value.message() == DISABLED
    assert http.get_system_shared_memory_status() == []
    _good_request(server)
    assert server.stop() == 0


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_numeric_round_trip_with_offsets(shm_server: GeserveProcess, regions: Any, protocol: str) -> None:
    module: Any = httpclient if protocol == "http" else grpcclient
    url = shm_server.url if protocol == "http" else f"127.0.0.1:{shm_server.grpc_port}"
    client = module.InferenceServerClient(url)
    left = np.arange(16, dtype=np.int32).reshape(1, 16)
    right = np.full((1, 16), 5, dtype=np.int32)
    in_key, in_handle = regions(256)
    out_key, out_handle = regions(256)
    # The inputs sit at 32 and 96 of the segment; the region starts at 16, so their offsets are 16 and 80.
    shm.set_shared_memory_region(in_handle, [left], offset=32)
    shm.set_shared_memory_region(in_handle, [right], offset=96)
    name_in, name_out = f"in-{protocol}", f"out-{protocol}"
    client.register_system_shared_memory(name_in, in_key, 200, offset=16)
    client.register_system_shared_memory(name_out, out_key, 256)
    try:
        inputs = [module.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
        inputs[0].set_shared_memory(name_in, 64, offset=16)
        inputs[1].set_shared_memory(name_in, 64, offset=80)
        outputs = [module.InferRequestedOutput("OUTPUT0"), module.InferRequestedOutput("OUTPUT1")]
        outputs[0].set_shared_memory(name_out, 64, offset=0)
        outputs[1].set_shared_memory(name_out, 64, offset=128)
        result = client.infer("simple", inputs, outputs=outputs)
        answered = result.get_output("OUTPUT0")
        shape = answered["shape"] if protocol == "http" else list(answered.shape)
        assert shape == [1, 16]  # described, with the data in the region
        if protocol == "http":
            assert "data" not in answered and "parameters" not in answered
        total = shm.get_contents_as_numpy(out_handle, np.int32, [1, 16], offset=0)
        difference = shm.get_contents_as_numpy(out_handle, np.int32, [1, 16], offset=128)
        np.testing.assert_array_equal(total, left + right)
        np.testing.assert_array_equal(difference, left - right)
        status = client.get_system_shared_memory_status(**({"as_json": True} if protocol == "grpc" else {}))
        names = {r["name"] for r in status} if protocol == "http" else set(status["regions"])
        assert {name_in, name_out} <= names
    finally:
        client.unregister_system_shared_memory(name_in)
        client.unregister_system_shared_memory(name_out)


def test_bytes_round_trip(shm_server: GeserveProcess, regions: Any) -> None:
    client = httpclient.InferenceServerClient(shm_server.url)
    left = np.array([[str(i).encode() for i in range(16)]], dtype=np.object_)
    right = np.array([[b"1"] * 16], dtype=np.object_)
    left_bytes, right_bytes = serialize_byte_tensor(left).item(), serialize_byte_tensor(right).item()
    key, handle = regions(1024)
    shm.set_shared_memory_region(handle, [np.frombuffer(left_bytes, dtype=np.uint8)], offset=0)
    shm.set_shared_memory_region(handle, [np.frombuffer(right_bytes, dtype=np.uint8)], offset=256)
    client.register_system_shared_memory("strings", key, 1024)
    try:
        inputs = [httpclient.InferInput(n, [1, 16], "BYTES") for n in ("INPUT0", "INPUT1")]
        inputs[0].set_shared_memory("strings", len(left_bytes), offset=0)
        inputs[1].set_shared_memory("strings", len(right_bytes), offset=256)
        output = httpclient.InferRequestedOutput("OUTPUT0")
        output.set_shared_memory("strings", 256, offset=512)
        client.infer("simple_string", inputs, outputs=[output])
        total = shm.get_contents_as_numpy(handle, np.object_, [1, 16], offset=512)
        assert [int(v) for v in total.reshape(-1)] == [i + 1 for i in range(16)]
    finally:
        client.unregister_system_shared_memory()
    assert client.get_system_shared_memory_status() == []


@pytest.mark.parametrize(
    ("key", "size", "message"),
    [
        ("/geserve_0123", 64, "as the key contains the reserved prefix 'geserve_'"),
        ("/triton_python_backend_shm_region_7", 64, "reserved prefix 'triton_python_backend_shm_region_'"),
        ("/", 64, "invalid shm key '/'"),
        ("///", 64, "invalid shm key '///'"),
        ("/..", 64, "invalid shm key '/..'"),
        ("/no-such-segment-here", 64, "Unable to open shared memory region"),
    ],
)
def test_register_refusals_then_a_good_request(shm_server: GeserveProcess, key: str, size: int, message: str) -> None:
    for client in (
        httpclient.InferenceServerClient(shm_server.url),
        grpcclient.InferenceServerClient(f"127.0.0.1:{shm_server.grpc_port}"),
    ):
        with pytest.raises(InferenceServerException) as error:
            client.register_system_shared_memory("bad", key, size)
        assert message in error.value.message()
    _good_request(shm_server)


def test_register_bounds_and_duplicates(shm_server: GeserveProcess, regions: Any) -> None:
    client = httpclient.InferenceServerClient(shm_server.url)
    key, _ = regions(64)
    with pytest.raises(InferenceServerException) as error:
        client.register_system_shared_memory("too-big", key, 65)
    assert "failed to register shared memory region 'too-big': invalid args" in error.value.message()
    with pytest.raises(InferenceServerException) as error:
        client.register_system_shared_memory("past-end", key, 64, offset=1)
    assert "invalid args" in error.value.message()
    client.register_system_shared_memory("once", key, 64)
    try:
        with pytest.raises(InferenceServerException) as error:
            client.register_system_shared_memory("once", key, 64)
        assert error.value.message() == "shared memory region 'once' already in manager"
    finally:
        client.unregister_system_shared_memory("once")
    _good_request(shm_server)


@pytest.mark.parametrize(
    ("offset", "size", "region", "message"),
    [
        (0, 64, "missing", "Unable to find system shared memory region: 'missing'"),
        (200, 64, "req", "Invalid offset for shared memory region: 'req'"),
        (100, 64, "req", "Invalid offset + byte size for shared memory region: 'req'"),
        (2**62, 2**62, "req", "Invalid offset for shared memory region: 'req'"),
        (0, 32, "req", "input byte size mismatch for input 'INPUT0'"),
    ],
)
def test_request_bounds_are_checked(
    shm_server: GeserveProcess, regions: Any, offset: int, size: int, region: str, message: str
) -> None:
    client = httpclient.InferenceServerClient(shm_server.url)
    key, _ = regions(128)
    client.register_system_shared_memory("req", key, 128)
    try:
        inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
        inputs[0].set_shared_memory(region, size, offset=offset)
        inputs[1].set_data_from_numpy(np.zeros((1, 16), dtype=np.int32))
        with pytest.raises(InferenceServerException) as error:
            client.infer("simple", inputs)
        assert error.value.status() == "400"
        assert message in error.value.message()
        output = httpclient.InferRequestedOutput("OUTPUT0")
        output.set_shared_memory("req", 32, offset=0)  # 64 bytes of result
        inputs[0].set_data_from_numpy(np.zeros((1, 16), dtype=np.int32))
        with pytest.raises(InferenceServerException) as error:
            client.infer("simple", inputs, outputs=[output])
        assert "should be at least 64 bytes to hold the results" in error.value.message()
    finally:
        client.unregister_system_shared_memory("req")
    _good_request(shm_server)


def _peak_rss_mib(server: GeserveProcess) -> list[float]:
    """Each of the server's own processes' peak resident memory (VmHWM)."""
    peaks = []
    for pid in server_pids(server):
        with open(f"/proc/{pid}/status") as status:
            peaks += [int(line.split()[1]) / 1024 for line in status if line.startswith("VmHWM:")]
    return peaks


def test_a_huge_region_is_not_read_for_a_small_input(shm_server: GeserveProcess, regions: Any) -> None:
    """A sparse GiB named as the byte size of a 64-byte input: refused before any of it is read."""
    client = httpclient.InferenceServerClient(shm_server.url)
    size = 1 << 30
    key, _ = regions(size)  # ftruncate'd, never written: it costs the client nothing
    client.register_system_shared_memory("sparse", key, size)
    try:
        before = _peak_rss_mib(shm_server)
        inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
        inputs[0].set_shared_memory("sparse", size)
        inputs[1].set_data_from_numpy(np.zeros((1, 16), dtype=np.int32))
        with pytest.raises(InferenceServerException) as error:
            client.infer("simple", inputs)
        assert error.value.status() == "400"
        assert f"input byte size mismatch for input 'INPUT0' for model 'simple'. Expected 64, got {size}" in str(
            error.value.message()
        )
        after = _peak_rss_mib(shm_server)
        assert all(late - early < 256 for early, late in zip(before, after, strict=True)), (before, after)
    finally:
        client.unregister_system_shared_memory("sparse")
    _good_request(shm_server)


def _memory_mib(pids: list[int]) -> dict[int, tuple[float, float]]:
    """Each process's resident memory now and at its peak (VmRSS, VmHWM), in MiB."""
    found: dict[int, tuple[float, float]] = {}
    for pid in pids:
        with open(f"/proc/{pid}/status") as status:
            fields = dict(line.split(":", 1) for line in status)
        found[pid] = (int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024)
    return found


def test_a_free_gib_input_is_read_in_place_at_no_cost_to_the_server(shm_server: GeserveProcess, regions: Any) -> None:
    """A valid 1 GiB input in a sparse region (which costs its client nothing) is read where it lies: the answer is
    right, no process of the server (workers included) grows by 64 MiB, and the client's segment stays sparse."""
    client = httpclient.InferenceServerClient(shm_server.url)
    key, _ = regions(GIB)
    segment = f"/dev/shm{key}"
    with open(segment, "r+b") as region:  # a few values; the rest stays holes
        for index, value in ((0, 1.5), (12_345_678, 2.0), (GIB // 4 - 1, 4.0)):
            os.pwrite(region.fileno(), np.float32(value).tobytes(), index * 4)
    client.register_system_shared_memory("free", key, GIB)
    try:
        inputs = [httpclient.InferInput("X", [GIB // 4], "FP32")]
        inputs[0].set_shared_memory("free", GIB)
        client.infer("sum", [httpclient.InferInput("X", [1], "FP32").set_data_from_numpy(np.ones(1, np.float32))])
        pids = server_pids(shm_server) + worker_pids(shm_server)
        before, blocks_before = _memory_mib(pids), os.stat(segment).st_blocks
        result = client.infer("sum", inputs)
        assert result.as_numpy("Y").tolist() == [7.5]
        after, blocks_after = _memory_mib(pids), os.stat(segment).st_blocks
        grown = {pid: after[pid][1] - before[pid][1] for pid in pids}
        assert all(growth < 64 for growth in grown.values()), (before, after)
        assert (blocks_after - blocks_before) * 512 < 64 << 20, "reading the region filled its holes"
    finally:
        client.unregister_system_shared_memory("free")
    _good_request(shm_server)


def test_cuda_endpoints_exist_but_cannot_register(shm_server: GeserveProcess) -> None:
    http = httpclient.InferenceServerClient(shm_server.url)
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{shm_server.grpc_port}")
    assert http.get_cuda_shared_memory_status() == []
    http.unregister_cuda_shared_memory()
    grpc.unregister_cuda_shared_memory()
    with pytest.raises(InferenceServerException) as error:
        http.register_cuda_shared_memory("c", b"\x00" * 64, 0, 64)
    assert error.value.status() == "501"
    with pytest.raises(InferenceServerException) as error:
        grpc.register_cuda_shared_memory("c", b"\x00" * 64, 0, 64)
    assert error.value.status() == "StatusCode.UNIMPLEMENTED"
    _good_request(shm_server)


@pytest.mark.timeout(600)
def test_perf_analyzer_with_system_shared_memory(shm_server: GeserveProcess, perf_analyzer: str) -> None:
    output = run_briefly(perf_analyzer, "http", shm_server.url, "--shared-memory", "system")
    assert "Server:" in output and "compute infer" in output
    assert httpclient.InferenceServerClient(shm_server.url).get_system_shared_memory_status() == []


def _shrink(key: str) -> None:
    os.truncate(f"/dev/shm/{key.strip('/')}", 0)


def _replace(key: str) -> None:
    path = f"/dev/shm/{key.strip('/')}"
    os.unlink(path)
    with open(path, "wb") as replacement:
        replacement.truncate(1 << 20)


def _remove(key: str) -> None:
    os.unlink(f"/dev/shm/{key.strip('/')}")


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("side", ["input", "output"])
@pytest.mark.parametrize(
    ("damage", "words"),
    [(_shrink, "shrank to 0 bytes"), (_remove, "no longer exists"), (_replace, "was replaced")],
    ids=["shrunk", "removed", "replaced"],
)
def test_a_region_that_shrinks_disappears_or_is_replaced_is_a_400_and_the_server_lives(
    shm_server: GeserveProcess, regions: Any, protocol: str, side: str, damage: Any, words: str
) -> None:
    """Reading or writing mapped memory past a shrunk segment's end would raise SIGBUS in the server."""
    module: Any = httpclient if protocol == "http" else grpcclient
    url = shm_server.url if protocol == "http" else f"127.0.0.1:{shm_server.grpc_port}"
    client = module.InferenceServerClient(url)
    key, handle = regions(1 << 20)
    data = np.arange(16, dtype=np.int32).reshape(1, 16)
    shm.set_shared_memory_region(handle, [data], offset=8192)
    name = f"damaged-{protocol}-{side}-{uuid.uuid4().hex[:6]}"
    client.register_system_shared_memory(name, key, 1 << 20)
    try:
        damage(key)
        inputs = [module.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
        outputs = [module.InferRequestedOutput("OUTPUT0")]
        if side == "input":
            inputs[0].set_shared_memory(name, 64, offset=8192)
            inputs[1].set_data_from_numpy(data)
        else:
            for tensor in inputs:
                tensor.set_data_from_numpy(data)
            outputs[0].set_shared_memory(name, 64, offset=8192)
        with pytest.raises(InferenceServerException) as error:
            client.infer("simple", inputs, outputs=outputs)
        assert error.value.status() == ("400" if protocol == "http" else "StatusCode.INVALID_ARGUMENT")
        assert f"shared memory region '{name}'" in error.value.message() and words in error.value.message()
        assert shm_server.process.poll() is None, shm_server.log()
        _good_request(shm_server)
    finally:
        client.unregister_system_shared_memory(name)
