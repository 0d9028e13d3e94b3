"""gRPC caps a client cannot get past: message size, calls in progress, streams per connection, connections; each
refused with gRPC's status, and the server keeps serving."""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from geserve._generated import grpc_service_pb2, grpc_service_pb2_grpc
from tests.support import GeserveProcess, write_identity_model

pytestmark = pytest.mark.e2e

Launch = Callable[..., GeserveProcess]
DELAY_MS = 3000  # the slow model's execute: long enough for the calls below to overlap it


def _server(launch: Launch, repository: Path, *flags: str) -> GeserveProcess:
    write_identity_model(repository, "echo")
    write_identity_model(
        repository,
        "slow",
        max_batch_size=0,
        extra=f'parameters {{ key: "execute_delay_ms" value: {{ string_value: "{DELAY_MS}" }} }}',
    )
    return launch(f"--model-repository={repository}", *flags).wait_live()


def _echo(client: grpcclient.InferenceServerClient, values: int = 2, model: str = "echo") -> None:
    shape = [1, values] if model == "echo" else [values]
    data = np.arange(values, dtype=np.float32).reshape(shape)
    tensor = grpcclient.InferInput("INPUT0", shape, "FP32")
    tensor.set_data_from_numpy(data)
    np.testing.assert_array_equal(client.infer(model, [tensor]).as_numpy("OUTPUT0"), data)


def _channel(target: str) -> grpc.Channel:
    """A channel on a connection of its own (by default, channels to one target share a connection)."""
    return grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])


def _client(server: GeserveProcess) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")


def test_a_message_past_the_size_cap_is_refused_and_the_connection_serves_on(launch: Launch, repository: Path) -> None:
    server = _server(launch, repository, f"--grpc-max-message-size={1 << 20}")
    with contextlib.closing(_client(server)) as client:
        with pytest.raises(InferenceServerException) as refused:
            _echo(client, values=(2 << 20) // 4)  # 2 MiB of FP32
        assert refused.value.status() == "StatusCode.RESOURCE_EXHAUSTED", refused.value
        assert "larger than max" in refused.value.message(), refused.value.message()
        _echo(client)
        _echo(client, values=(512 << 10) // 4)  # under the cap
    assert server.stop() == 0, server.log()


def test_calls_past_the_inflight_cap_are_refused_at_once(launch: Launch, repository: Path) -> None:
    """Three calls on one connection (so in one process, however many serve gRPC), two of them allowed."""
    server = _server(launch, repository, "--grpc-max-inflight-rpcs=2")
    with concurrent.futures.ThreadPoolExecutor(2) as pool, contextlib.closing(_client(server)) as client:
        busy = [pool.submit(_echo, client, 2, "slow") for _ in range(2)]
        time.sleep(DELAY_MS / 3000)  # both calls are in the server (nothing outside shows when)
        with pytest.raises(InferenceServerException) as refused:
            _echo(client)
        assert refused.value.status() == "StatusCode.RESOURCE_EXHAUSTED", refused.value
        for call in busy:
            call.result(timeout=60)  # the two in progress are answered
        _echo(client)  # and room again once they are
    assert server.stop() == 0, server.log()


def test_streams_past_the_per_connection_cap_wait_for_a_free_one(launch: Launch, repository: Path) -> None:
    """One connection, one stream: a second call on it waits (HTTP/2 flow), one on another connection does not."""
    server = _server(launch, repository, "--grpc-max-concurrent-streams=1")
    target = f"127.0.0.1:{server.grpc_port}"
    with _channel(target) as channel, _channel(target) as other:
        stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
        stub.ServerLive(grpc_service_pb2.ServerLiveRequest(), timeout=30)  # connected, SETTINGS exchanged
        request = grpc_service_pb2.ModelInferRequest(model_name="slow")
        tensor = request.inputs.add(name="INPUT0", datatype="FP32", shape=[2])
        tensor.contents.fp32_contents.extend([1.0, 2.0])
        slow = stub.ModelInfer.future(request, timeout=60)
        time.sleep(0.5)
        with pytest.raises(grpc.RpcError) as waited:
            stub.ServerLive(grpc_service_pb2.ServerLiveRequest(), timeout=1.0)
        assert waited.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, waited.value
        other_stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(other)
        assert other_stub.ServerLive(grpc_service_pb2.ServerLiveRequest(), timeout=30).live
        assert slow.result().outputs[0].name == "OUTPUT0"
        assert stub.ServerLive(grpc_service_pb2.ServerLiveRequest(), timeout=30).live
    assert server.stop() == 0, server.log()


def test_connections_past_the_cap_are_closed_and_a_freed_slot_is_reused(launch: Launch, repository: Path) -> None:
    """The cap is per process: with P protocol processes, which the kernel hands each connection to, the first
    refused connection is past the cap and at most P times it."""
    cap = 2
    server = _server(launch, repository, f"--grpc-max-connections={cap}")
    processes = max(server.frontend_processes, 1)
    target = f"127.0.0.1:{server.grpc_port}"
    live = grpc_service_pb2.ServerLiveRequest()
    channels: list[Any] = []
    refused: grpc.RpcError | None = None
    while refused is None and len(channels) <= cap * processes:
        channels.append(_channel(target))
        try:
            grpc_service_pb2_grpc.GRPCInferenceServiceStub(channels[-1]).ServerLive(live, timeout=3)
        except grpc.RpcError as error:
            refused = error
    assert refused is not None, f"{len(channels)} connections, none refused"
    assert cap < len(channels) <= cap * processes + 1, len(channels)
    assert refused.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), refused
    for channel in channels:
        channel.close()
    deadline = time.monotonic() + 30
    while True:  # the server sees the closes a moment later
        fresh = _channel(target)
        try:
            assert grpc_service_pb2_grpc.GRPCInferenceServiceStub(fresh).ServerLive(live, timeout=3).live
            break
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise
        finally:
            fresh.close()
    assert server.stop() == 0, server.log()
