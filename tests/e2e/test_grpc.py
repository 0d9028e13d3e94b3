"""gRPC specifics against a real geserve: typed contents, parameters, health, streams, unimplemented RPCs."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.support import GeserveProcess, copy_model

pytestmark = pytest.mark.e2e

INT32_MAX = 2**31 - 1


@pytest.fixture
def client(server: GeserveProcess) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")


@pytest.fixture
def stub(server: GeserveProcess) -> service_pb2_grpc.GRPCInferenceServiceStub:
    channel = grpc.insecure_channel(
        f"127.0.0.1:{server.grpc_port}",
        options=[("grpc.max_send_message_length", INT32_MAX), ("grpc.max_receive_message_length", INT32_MAX)],
    )
    return service_pb2_grpc.GRPCInferenceServiceStub(channel)


def test_health_metadata_and_config_match_http(
    server: GeserveProcess, client: grpcclient.InferenceServerClient
) -> None:
    http = httpclient.InferenceServerClient(server.url)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("simple") and not client.is_model_ready("simple", "2")
    metadata = client.get_server_metadata()
    assert (metadata.name, metadata.version, list(metadata.extensions)) == tuple(http.get_server_metadata().values())
    for model in ("simple", "simple_string", "digits"):
        grpc_metadata = client.get_model_metadata(model, as_json=True)
        for tensor in grpc_metadata["inputs"] + grpc_metadata["outputs"]:
            tensor["shape"] = [int(d) for d in tensor["shape"]]
        assert grpc_metadata == http.get_model_metadata(model)
        config = client.get_model_config(model).config
        http_config = http.get_model_config(model)
        assert config.name == http_config["name"] and config.max_batch_size == http_config["max_batch_size"]
        assert [(t.name, list(t.dims)) for t in config.input] == [(t["name"], t["dims"]) for t in http_config["input"]]
        assert config.instance_group[0].kind == grpcclient.model_config_pb2.ModelInstanceGroup.KIND_CPU
        assert config.HasField("dynamic_batching") == ("dynamic_batching" in http_config)


def test_unknown_model_is_an_error_for_model_ready(client: grpcclient.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException) as error:
        client.is_model_ready("nope")
    assert error.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert error.value.message() == "Request for unknown model: 'nope' is not found"


def _health(port: int) -> bytes:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        check: Callable[..., bytes] = channel.unary_unary(
            "/grpc.health.v1.Health/Check", request_serializer=lambda m: m, response_deserializer=lambda m: m
        )
        return check(b"", timeout=10)


def test_health_service_and_not_ready_model(launch: Callable[..., GeserveProcess], repository: Path) -> None:
    copy_model("simple", repository)
    (repository / "broken" / "1").mkdir(parents=True)
    server = launch(f"--model-repository={repository}", "--exit-on-error=false").wait_live()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    assert not client.is_model_ready("broken")  # known but not ready: false, not an error
    assert not client.is_server_ready()
    assert _health(server.grpc_port) == b"\x08\x02"  # NOT_SERVING
    ready = launch(f"--model-repository={repository}", "--exit-on-error=false", "--strict-readiness=false").wait_live()
    assert _health(ready.grpc_port) == b"\x08\x01"  # SERVING


def test_typed_contents(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    request = service_pb2.ModelInferRequest(model_name="simple", id="typed")
    for name, values in (("INPUT0", list(range(16))), ("INPUT1", [3] * 16)):
        tensor = request.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        tensor.contents.int_contents.extend(values)
    response = stub.ModelInfer(request)
    assert response.id == "typed" and [o.name for o in response.outputs] == ["OUTPUT0", "OUTPUT1"]
    assert len(response.raw_output_contents) == 2
    assert np.frombuffer(response.raw_output_contents[0], dtype=np.int32).tolist() == [x + 3 for x in range(16)]
    assert not response.outputs[0].HasField("contents")

    request = service_pb2.ModelInferRequest(model_name="simple_string")
    for name in ("INPUT0", "INPUT1"):
        request.inputs.add(name=name, datatype="BYTES", shape=[1, 16]).contents.bytes_contents.extend([b"2"] * 16)
    response = stub.ModelInfer(request)
    framed = response.raw_output_contents[0]
    assert framed == (b"\x01\x00\x00\x004") * 16

    request = service_pb2.ModelInferRequest(model_name="digits")
    request.inputs.add(name="pixels", datatype="FP32", shape=[1, 64]).contents.fp32_contents.extend([0.0] * 64)
    probabilities = np.frombuffer(stub.ModelInfer(request).raw_output_contents[0], dtype=np.float32)
    assert probabilities.shape == (10,) and abs(float(probabilities.sum()) - 1.0) < 1e-4


def _expect_error(
    stub: service_pb2_grpc.GRPCInferenceServiceStub, request: service_pb2.ModelInferRequest
) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as error:
        stub.ModelInfer(request)
    good = service_pb2.ModelInferRequest(model_name="simple")
    for name in ("INPUT0", "INPUT1"):
        good.inputs.add(name=name, datatype="INT32", shape=[1, 16]).contents.int_contents.extend([1] * 16)
    assert np.frombuffer(stub.ModelInfer(good).raw_output_contents[0], dtype=np.int32).tolist() == [2] * 16
    return error.value


def test_bad_contents(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    request = service_pb2.ModelInferRequest(model_name="simple")
    request.inputs.add(name="INPUT0", datatype="INT32", shape=[1, 16]).contents.int_contents.extend([1] * 15)
    error = _expect_error(stub, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        error.details()
        == "unexpected number of elements 15 in 'int_contents' of input 'INPUT0': shape [1, 16] needs 16"
    )

    request = service_pb2.ModelInferRequest(model_name="simple")
    request.inputs.add(name="INPUT0", datatype="INT32", shape=[1, 16])
    request.inputs.add(name="INPUT1", datatype="INT32", shape=[1, 16])
    request.raw_input_contents.append(bytes(64))
    error = _expect_error(stub, request)
    assert error.details() == "expected 2 entries in raw_input_contents, one per input, got 1"

    request.raw_input_contents.append(bytes(64))
    request.inputs[1].contents.int_contents.append(1)
    error = _expect_error(stub, request)
    assert "has 'contents' but the request uses raw_input_contents" in error.details()

    request = service_pb2.ModelInferRequest(model_name="digits")
    request.inputs.add(name="pixels", datatype="FP16", shape=[1, 64])
    error = _expect_error(stub, request)
    assert error.details() == "input 'pixels': FP16 data can only be sent in raw_input_contents"

    request = service_pb2.ModelInferRequest(model_name="digits")
    request.inputs.add(name="pixels", datatype="NOPE", shape=[1, 64])
    assert _expect_error(stub, request).details() == "invalid datatype 'NOPE'"


def test_request_parameters(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    def request_with(**parameters: service_pb2.InferParameter) -> service_pb2.ModelInferRequest:
        request = service_pb2.ModelInferRequest(model_name="simple")
        for name in ("INPUT0", "INPUT1"):
            request.inputs.add(name=name, datatype="INT32", shape=[1, 16]).contents.int_contents.extend([1] * 16)
        for key, value in parameters.items():
            request.parameters[key].CopyFrom(value)
        return request

    accepted = request_with(
        priority=service_pb2.InferParameter(uint64_param=1),
        timeout=service_pb2.InferParameter(int64_param=1000),
        sequence_id=service_pb2.InferParameter(string_param="s-1"),
        my_custom=service_pb2.InferParameter(bool_param=True),
        triton_enable_empty_final_response=service_pb2.InferParameter(bool_param=True),
    )
    assert len(stub.ModelInfer(accepted).raw_output_contents) == 2
    assert (
        len(stub.ModelInfer(request_with(priority=service_pb2.InferParameter(int64_param=2))).raw_output_contents) == 2
    )
    error = _expect_error(stub, request_with(triton_custom=service_pb2.InferParameter(int64_param=1)))
    assert error.details().startswith("parameter keys starting with 'triton_' are reserved")
    error = _expect_error(stub, request_with(priority=service_pb2.InferParameter(string_param="high")))
    assert error.details() == "parameter 'priority' must be a non-negative integer, got 'high'"


def _simple_inputs(left: np.ndarray, right: np.ndarray) -> list[grpcclient.InferInput]:
    inputs = []
    for name, array in (("INPUT0", left), ("INPUT1", right)):
        tensor = grpcclient.InferInput(name, list(array.shape), "INT32")
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def test_stream_with_grpc_error_header_closes_on_error(server: GeserveProcess) -> None:
    answers: queue.Queue[tuple[object, InferenceServerException | None]] = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    client.start_stream(
        callback=lambda result, error: answers.put((result, error)), headers={"triton_grpc_error": "true"}
    )
    good = np.ones((1, 16), dtype=np.int32)
    client.async_stream_infer("simple", _simple_inputs(good, good), request_id="ok")
    _, error = answers.get(timeout=30)
    assert error is None
    client.async_stream_infer("nope", _simple_inputs(good, good), request_id="bad")
    _, error = answers.get(timeout=30)
    assert error is not None
    assert error.status() == "StatusCode.INVALID_ARGUMENT"
    assert error.message() == "[request id: bad] Request for unknown model: 'nope' is not found"
    client.stop_stream()
    client.close()


def test_empty_final_response_flag_on_stream_responses(server: GeserveProcess) -> None:
    answers: queue.Queue[tuple[object, object]] = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    good = np.ones((1, 16), dtype=np.int32)
    client.async_stream_infer("simple", _simple_inputs(good, good), enable_empty_final_response=True)
    result, error = answers.get(timeout=30)
    assert error is None
    assert result.get_response().parameters["triton_final_response"].bool_param is True  # type: ignore[attr-defined]
    client.stop_stream()
    client.close()


def test_many_concurrent_streams_with_interleaved_requests(server: GeserveProcess) -> None:
    streams, per_stream = 8, 40
    failures: list[str] = []

    def run_stream(stream: int) -> None:
        answers: queue.Queue[tuple[object, InferenceServerException | None]] = queue.Queue()
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        expected = {}
        for index in range(per_stream):
            batch = 1 + (index + stream) % 8
            left = (np.arange(batch * 16, dtype=np.int32) + stream * 100_000 + index * 1000).reshape(batch, 16)
            right = np.full((batch, 16), index - stream, dtype=np.int32)
            request_id = f"{stream}-{index}"
            if index % 10 == 7:  # an error in the middle must not disturb the others
                client.async_stream_infer("nope", _simple_inputs(left, right), request_id=request_id)
                expected[request_id] = None
            else:
                client.async_stream_infer("simple", _simple_inputs(left, right), request_id=request_id)
                expected[request_id] = (left + right, left - right)
        errors = 0
        for _ in range(per_stream):
            result, error = answers.get(timeout=60)
            if error is not None:
                errors += 1
                continue
            response_id = result.get_response().id  # type: ignore[attr-defined]
            sums, differences = expected.pop(response_id)  # type: ignore[misc]
            if not (
                np.array_equal(result.as_numpy("OUTPUT0"), sums)
                and np.array_equal(result.as_numpy("OUTPUT1"), differences)
            ):  # type: ignore[attr-defined]
                failures.append(f"wrong values for {response_id}")
        if errors != sum(1 for value in expected.values() if value is None):
            failures.append(f"stream {stream}: {errors} errors")
        client.stop_stream()
        client.close()

    threads = [threading.Thread(target=run_stream, args=(stream,)) for stream in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not failures


GARBAGE = [b"\xff\xff\xff\xff\x0f", b"\x0a\xff\xff\xff\xff\xff\xff", b"\x12\x05abc", bytes(range(256))]


def test_undecodable_messages_are_invalid_argument_without_tracebacks(
    launch: Callable[..., GeserveProcess], repository: Path
) -> None:
    copy_model("simple", repository)
    server = launch(f"--model-repository={repository}").wait_live()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    for method in ("ModelInfer", "ServerLive", "ModelMetadata", "RepositoryModelLoad", "SystemSharedMemoryRegister"):
        call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")
        for data in GARBAGE:
            with pytest.raises(grpc.RpcError) as error:
                call(data, timeout=10)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, data)
            assert "unable to parse the request as inference." in str(error.value.details())
    health = channel.unary_unary("/grpc.health.v1.Health/Check")
    with pytest.raises(grpc.RpcError) as error:
        health(GARBAGE[0], timeout=10)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
    with pytest.raises(grpc.RpcError) as error:
        list(stream(iter([GARBAGE[0]]), timeout=10))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    channel.close()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    data = np.ones((1, 16), dtype=np.int32)
    inputs = [grpcclient.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
    for tensor in inputs:
        tensor.set_data_from_numpy(data)
    np.testing.assert_array_equal(client.infer("simple", inputs).as_numpy("OUTPUT0"), data * 2)
    assert "Traceback" not in server.log() and "Exception deserializing" not in server.log()
