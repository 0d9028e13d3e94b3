"""Client shared memory is capped: past --max-client-shm-regions or --max-client-shm-bytes a registration is refused
naming the flag, over HTTP and gRPC, and the server keeps serving (each region holds a file descriptor)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from tests.support import GeserveProcess, copy_model

pytestmark = pytest.mark.e2e

Launch = Callable[..., GeserveProcess]
MAX_REGIONS = 3
MAX_BYTES = 4096


@pytest.fixture
def segments() -> Iterator[Callable[[int], str]]:
    """Client segments with unique keys, destroyed at teardown."""
    handles: list[Any] = []

    def create(size: int) -> str:
        key = f"/geserve-limit-{uuid.uuid4().hex}"
        handles.append(shm.create_shared_memory_region(key.strip("/"), key, size))
        return key

    yield create
    for handle in handles:
        with contextlib.suppress(FileNotFoundError):
            shm.destroy_shared_memory_region(handle)


def _server(launch: Launch, tmp_path: Any, protocol: str) -> tuple[GeserveProcess, Any, Any]:
    """A server with the caps set low, the tritonclient module of `protocol` ("http" or "grpc"), and its client."""
    repository = tmp_path / "models"
    copy_model("simple", repository)
    server = launch(
        f"--model-repository={repository}",
        "--allow-client-shm=true",
        f"--max-client-shm-regions={MAX_REGIONS}",
        f"--max-client-shm-bytes={MAX_BYTES}",
    ).wait_live()
    if protocol == "http":
        return server, httpclient, httpclient.InferenceServerClient(server.url)
    return server, grpcclient, grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")


def _infer_from_region(client: Any, module: Any, region: str, key: str) -> None:
    """A request whose inputs are in a region registered right now: it is served."""
    data = np.arange(16, dtype=np.int32).reshape(1, 16)
    handle = shm.create_shared_memory_region(f"{region}-data", f"{key}-data", data.nbytes)
    try:
        shm.set_shared_memory_region(handle, [data])
        client.register_system_shared_memory(region, f"{key}-data", data.nbytes)
        inputs = [module.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
        for tensor in inputs:
            tensor.set_shared_memory(region, data.nbytes)
        result = client.infer("simple", inputs)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data * 2)
        client.unregister_system_shared_memory(region)
    finally:
        shm.destroy_shared_memory_region(handle)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_registrations_past_the_region_cap_are_refused_naming_the_flag(
    launch: Launch, tmp_path: Any, segments: Callable[[int], str], protocol: str
) -> None:
    server, module, client = _server(launch, tmp_path, protocol)
    keys = [segments(64) for _ in range(MAX_REGIONS + 1)]
    for index, key in enumerate(keys[:MAX_REGIONS]):
        client.register_system_shared_memory(f"r{index}", key, 64)
    with pytest.raises(InferenceServerException) as refused:
        client.register_system_shared_memory("one_more", keys[-1], 64)
    message = refused.value.message()
    assert "'one_more'" in message and "--max-client-shm-regions" in message, message
    assert "400" in str(refused.value.status()) or "INVALID_ARGUMENT" in str(refused.value.status())
    # Still serving; and a slot freed is a slot to register in.
    client.unregister_system_shared_memory("r0")
    _infer_from_region(client, module, "fresh", keys[0])
    assert server.stop() == 0, server.log()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_registrations_past_the_byte_cap_are_refused_naming_the_flag(
    launch: Launch, tmp_path: Any, segments: Callable[[int], str], protocol: str
) -> None:
    server, module, client = _server(launch, tmp_path, protocol)
    big = segments(MAX_BYTES)
    client.register_system_shared_memory("most", big, MAX_BYTES - 256)
    with pytest.raises(InferenceServerException) as refused:
        client.register_system_shared_memory("past_it", big, 512)
    message = refused.value.message()
    assert "'past_it'" in message and "--max-client-shm-bytes" in message, message
    assert [region["name"] for region in _status(client)] == ["most"]
    client.unregister_system_shared_memory("most")
    _infer_from_region(client, module, "fresh", big)
    assert server.stop() == 0, server.log()


def _status(client: Any) -> list[dict[str, Any]]:
    status = client.get_system_shared_memory_status()
    if isinstance(status, list):
        return status
    return [{"name": region.name} for region in status.regions.values()]
