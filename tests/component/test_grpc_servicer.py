"""The gRPC servicer called directly over an in-process service: messages, status codes and raw replies, no channel."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import numpy as np
import pytest

from geserve._generated import grpc_service_pb2 as pb
from geserve.core.api import InferenceAPI
from geserve.grpc.raw import parse_infer_request, serialize_infer_reply
from geserve.grpc.servicer import InferenceServicer


class AbortedError(Exception):
    """What grpc.aio's context.abort raises, as the servicer sees it: the RPC ends here."""


class Context:
    """The part of grpc.aio.ServicerContext the servicer uses."""

    def __init__(self, metadata: Sequence[tuple[str, str]] = ()) -> None:
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self._metadata = tuple(metadata)

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details
        raise AbortedError(details)

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata


def _infer_request(model: str, values: np.ndarray, request_id: str = "") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, id=request_id)
    request.inputs.add(name="INPUT0", datatype="FP32", shape=list(values.shape))
    request.raw_input_contents.append(values.tobytes())
    return request


async def _infer(servicer: InferenceServicer, request: pb.ModelInferRequest) -> pb.ModelInferResponse:
    """ModelInfer as grpc runs it: parsed from bytes, the reply serialized, then read back as a client does."""
    reply = await servicer.ModelInfer(parse_infer_request(request.SerializeToString()), Context())
    return pb.ModelInferResponse.FromString(serialize_infer_reply(reply))


@pytest.fixture
def servicer(service: InferenceAPI) -> InferenceServicer:
    return InferenceServicer(service)


async def test_health_metadata_and_config(servicer: InferenceServicer) -> None:
    context: Any = Context()
    assert (await servicer.ServerLive(pb.ServerLiveRequest(), context)).live
    assert (await servicer.ServerReady(pb.ServerReadyRequest(), context)).ready
    assert (await servicer.ModelReady(pb.ModelReadyRequest(name="echo"), context)).ready
    metadata = await servicer.ModelMetadata(pb.ModelMetadataRequest(name="simple"), context)
    assert [t.name for t in metadata.inputs] == ["INPUT0", "INPUT1"] and metadata.versions == ["1"]
    config = await servicer.ModelConfig(pb.ModelConfigRequest(name="simple"), context)
    assert config.config.max_batch_size == 8
    server = await servicer.ServerMetadata(pb.ServerMetadataRequest(), context)
    assert server.name == "triton" and "statistics" in server.extensions


async def test_infer_answers_each_request_with_its_own_values(servicer: InferenceServicer) -> None:
    for row in range(3):
        values = np.full((1, 5), row, dtype=np.float32)
        response = await _infer(servicer, _infer_request("echo", values, f"g{row}"))
        assert response.id == f"g{row}" and list(response.outputs[0].shape) == [1, 5]
        np.testing.assert_array_equal(np.frombuffer(response.raw_output_contents[0], np.float32), values.ravel())


async def test_an_error_becomes_its_status_and_the_next_request_is_served(servicer: InferenceServicer) -> None:
    context = Context()
    with pytest.raises(AbortedError):
        await servicer.ModelInfer(_infer_request("nope", np.zeros((1, 2), np.float32), "bad"), context)
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT
    assert context.details == "[request id: bad] Request for unknown model: 'nope' is not found"
    context = Context()
    with pytest.raises(AbortedError):
        await servicer.RepositoryIndex(pb.RepositoryIndexRequest(repository_name="other"), context)
    assert context.code == grpc.StatusCode.UNIMPLEMENTED
    values = np.ones((1, 2), np.float32)
    response = await _infer(servicer, _infer_request("echo", values))
    np.testing.assert_array_equal(np.frombuffer(response.raw_output_contents[0], np.float32), values.ravel())


async def test_a_stream_answers_every_request_and_reports_errors_in_band(servicer: InferenceServicer) -> None:
    async def requests() -> AsyncIterator[pb.ModelInferRequest]:
        yield _infer_request("echo", np.full((1, 2), 1, np.float32), "s1")
        yield _infer_request("nope", np.zeros((1, 2), np.float32), "s2")
        yield _infer_request("echo", np.full((1, 2), 3, np.float32), "s3")

    answers = [answer async for answer in servicer.ModelStreamInfer(requests(), Context())]
    by_id = {answer.infer_response.id: answer for answer in answers}
    assert set(by_id) == {"s1", "s2", "s3"}
    assert "Request for unknown model: 'nope' is not found" in by_id["s2"].error_message
    for request_id, value in (("s1", 1), ("s3", 3)):
        raw = by_id[request_id].infer_response.raw_output_contents[0]
        assert not by_id[request_id].error_message and np.frombuffer(raw, np.float32).tolist() == [value, value]


async def test_statistics_repository_and_settings(servicer: InferenceServicer) -> None:
    await _infer(servicer, _infer_request("echo", np.ones((1, 2), np.float32)))
    context: Any = Context()
    stats = await servicer.ModelStatistics(pb.ModelStatisticsRequest(name="echo"), context)
    assert stats.model_stats[0].inference_stats.success.count == 1
    index = await servicer.RepositoryIndex(pb.RepositoryIndexRequest(), context)
    assert {model.name for model in index.models} == {"echo", "simple"}
    regions = await servicer.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest(), context)
    assert not regions.regions
    logs = await servicer.LogSettings(pb.LogSettingsRequest(), context)
    assert "log_verbose_level" in logs.settings
    trace = await servicer.TraceSetting(pb.TraceSettingRequest(), context)
    assert "trace_rate" in trace.settings
