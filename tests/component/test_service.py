"""InferenceService in process, on thread instances, behind its FrontDoor: the whole InferenceAPI without a server or
a socket."""

from __future__ import annotations

import dataclasses
import pickle
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import pytest

from geserve.core.api import InferenceAPI
from geserve.errors import InvalidArgumentError, NotFoundError, UnavailableError
from geserve.settings import ServerSettings
from geserve.types import InferInput, InferRequest, RequestedOutput, VersionSnapshot
from tests.component.conftest import in_process_server
from tests.support import write_identity_model


def _request(model: str, values: np.ndarray, request_id: str = "") -> InferRequest:
    tensor = InferInput("INPUT0", "FP32", values.shape, values)
    return InferRequest(model, "", (tensor,), id=request_id)


async def test_health_and_metadata(service: InferenceAPI) -> None:
    assert await service.live() and await service.ready()
    metadata = await service.server_metadata()
    assert metadata.name == "triton" and "statistics" in metadata.extensions
    model = await service.model_metadata("echo")
    assert (model.name, model.versions, model.platform) == ("echo", ("1",), "identity")
    assert [(t.name, t.datatype, t.shape) for t in model.inputs] == [("INPUT0", "FP32", (-1, -1))]
    assert (await service.model_config("simple")).max_batch_size == 8
    assert [tensor.name for tensor in (await service.model_config("simple")).input] == ["INPUT0", "INPUT1"]
    assert await service.model_ready("echo", "1") and not await service.model_ready("echo", "2")


async def test_infer_answers_each_request_with_its_own_values(service: InferenceAPI) -> None:
    for row in range(3):
        values = np.full((1, 4), row, dtype=np.float32)
        response = await service.infer(_request("echo", values, f"r{row}"))
        assert response.id == f"r{row}" and response.model_name == "echo"
        np.testing.assert_array_equal(response.outputs[0].data, values)


async def test_a_bad_request_is_refused_and_the_next_good_one_served(service: InferenceAPI) -> None:
    with pytest.raises(InvalidArgumentError, match=r"\[request id: bad\] Request for unknown model: 'nope'"):
        await service.infer(_request("nope", np.zeros((1, 4), np.float32), "bad"))
    wrong = InferRequest("echo", "", (InferInput("INPUT0", "INT32", (1, 4), np.zeros((1, 4), np.int32)),))
    with pytest.raises(InvalidArgumentError, match="INPUT0"):
        await service.infer(wrong)
    with pytest.raises(NotFoundError):
        await service.model_metadata("echo", "7")
    values = np.arange(4, dtype=np.float32).reshape(1, 4)
    np.testing.assert_array_equal((await service.infer(_request("echo", values))).outputs[0].data, values)


async def test_statistics_and_metric_snapshots_are_plain_values(service: InferenceAPI) -> None:
    for _ in range(2):
        await service.infer(_request("echo", np.ones((1, 4), np.float32)))
    [entry] = await service.statistics("echo", "1")
    assert entry["inference_stats"]["success"]["count"] == 2
    snapshots = {s.name: s for s in await service.version_statistics()}
    echo = snapshots["echo"]
    assert isinstance(echo, VersionSnapshot) and echo.success.count == 2 and echo.inference_count == 2
    assert dict(echo.failures)["OTHER"] == 0 and snapshots["simple"].success.count == 0
    assert {s.family for s in echo.summaries} == {
        "request",
        "queue",
        "compute_input",
        "compute_infer",
        "compute_output",
    }
    assert echo.histogram is not None and echo.histogram.cumulative[-1] == 2
    # Nothing live: a snapshot survives pickling whole and does not move when the counters do.
    assert pickle.loads(pickle.dumps(echo)) == echo
    await service.infer(_request("echo", np.ones((1, 4), np.float32)))
    assert echo.success.count == 2 and dataclasses.is_dataclass(echo)
    assert await service.device_usage() == {} and await service.custom_metrics() == []


async def test_without_latency_metrics_no_summaries_are_kept(tmp_path: Path) -> None:
    write_identity_model(tmp_path, "echo")
    served = await in_process_server(tmp_path)
    service = served.door
    try:
        await service.infer(_request("echo", np.ones((1, 2), np.float32)))
        [echo] = await service.version_statistics()
        assert echo.summaries == () and echo.histogram is None and echo.success.count == 1
    finally:
        await served.shutdown()


async def test_repository_control_in_process(service: InferenceAPI) -> None:
    index = {entry["name"]: entry for entry in await service.repository_index()}
    assert index["echo"]["state"] == "READY" and index["simple"]["state"] == "READY"
    await service.unload_model("echo")
    assert not await service.model_ready("echo")
    assert [entry["name"] for entry in await service.repository_index(ready_only=True)] == ["simple"]
    await service.load_model("echo")
    assert await service.model_ready("echo")


async def test_trace_log_and_shared_memory_settings(service: InferenceAPI) -> None:
    assert await service.shared_memory_status() == []
    assert await service.cuda_shared_memory_status() == []
    changed = await service.update_trace_settings(None, {"trace_rate": "10"})
    assert changed["trace_rate"] == "10" and (await service.trace_settings("echo"))["trace_rate"] == "10"
    with pytest.raises(InvalidArgumentError):
        await service.trace_settings("nope")
    logs = await service.update_log_settings({"log_verbose_level": 1})
    assert logs["log_verbose_level"] == 1 and (await service.log_settings())["log_verbose_level"] == 1
    await service.update_log_settings({"log_verbose_level": 0})


async def test_client_shared_memory_in_and_out(tmp_path: Path) -> None:
    write_identity_model(tmp_path, "echo")
    served = await in_process_server(tmp_path, ServerSettings(allow_client_shm=True))
    service = served.door
    values = np.arange(6, dtype=np.float32).reshape(1, 6)
    region = shared_memory.SharedMemory(create=True, size=2 * values.nbytes)
    try:
        region.buf[: values.nbytes] = values.tobytes()
        await service.register_shared_memory("both", f"/{region.name}", 0, 2 * values.nbytes)
        assert [r["name"] for r in await service.shared_memory_status()] == ["both"]
        where = {"shared_memory_region": "both", "shared_memory_byte_size": values.nbytes}
        tensor = InferInput("INPUT0", "FP32", values.shape, np.empty(0, np.float32), where)
        output = RequestedOutput("OUTPUT0", {**where, "shared_memory_offset": values.nbytes})
        response = await service.infer(InferRequest("echo", "", (tensor,), (output,)))
        assert response.outputs[0].parameters["shared_memory_byte_size"] == values.nbytes
        written = np.ndarray(values.shape, np.float32, region.buf, offset=values.nbytes).copy()
        np.testing.assert_array_equal(written, values)
        await service.unregister_shared_memory("both")
        with pytest.raises(InvalidArgumentError, match="both"):
            await service.infer(InferRequest("echo", "", (tensor,)))
        np.testing.assert_array_equal((await service.infer(_request("echo", values))).outputs[0].data, values)
    finally:
        await served.shutdown()
        region.close()
        region.unlink()


async def test_client_shared_memory_is_refused_unless_allowed(service: InferenceAPI) -> None:
    with pytest.raises(UnavailableError, match="--allow-client-shm=true"):
        await service.register_shared_memory("r", "/some_region", 0, 16)
