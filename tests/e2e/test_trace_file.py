"""Triton's trace file through tritonclient, HTTP and gRPC: written in Triton's format, rotated by log_frequency."""

from __future__ import annotations

import json
import queue
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.support import GeserveProcess, copy_model, write_identity_model

pytestmark = pytest.mark.e2e

CORE = [
    "REQUEST_START",
    "QUEUE_START",
    "COMPUTE_START",
    "COMPUTE_INPUT_END",
    "COMPUTE_OUTPUT_START",
    "COMPUTE_END",
    "REQUEST_END",
    "INFER_RESPONSE_COMPLETE",
]
HTTP_NAMES = ["HTTP_RECV_START", "HTTP_RECV_END", *CORE, "HTTP_SEND_START", "HTTP_SEND_END"]
GRPC_NAMES = ["GRPC_WAITREAD_START", "GRPC_WAITREAD_END", *CORE, "GRPC_SEND_START", "GRPC_SEND_END"]


DATA = np.arange(16, dtype=np.int32).reshape(1, 16)


def _inputs(module: Any) -> list[Any]:
    inputs = [module.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
    for tensor in inputs:
        tensor.set_data_from_numpy(DATA)
    return inputs


def _infer(client: Any, module: Any, request_id: str) -> None:
    result = client.infer("simple", _inputs(module), request_id=request_id)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), DATA * 2)


def _stream_infer(client: grpcclient.InferenceServerClient, request_id: str) -> None:
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    client.async_stream_infer("simple", _inputs(grpcclient), request_id=request_id)
    result, error = answers.get(timeout=60)
    client.stop_stream()
    assert error is None
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), DATA * 2)


def _traces(path: Path) -> dict[int, dict[str, Any]]:
    """A Triton trace file's objects grouped by trace id, as Triton's trace_summary.py reads them: the
    object naming the model first, then the timestamps in the order written."""
    objects = json.loads(path.read_text())
    assert isinstance(objects, list)
    traces: dict[int, dict[str, Any]] = defaultdict(lambda: {"timestamps": []})
    for item in objects:
        trace = traces[item["id"]]
        if "model_name" in item:
            assert not trace["timestamps"], "the model object comes before the trace's timestamps"
            trace.update(model_name=item["model_name"], model_version=item["model_version"])
            trace.update(request_id=item.get("request_id", ""), parent_id=item.get("parent_id", 0))
        else:
            assert set(item) == {"id", "timestamps"} and len(item["timestamps"]) == 1
            trace["timestamps"].append((item["timestamps"][0]["name"], item["timestamps"][0]["ns"]))
    return dict(traces)


CHAIN = (
    'input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
    'output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
    "ensemble_scheduling { step [ "
    '{ model_name: "pass_a" model_version: -1 input_map { key: "INPUT0" value: "X" } '
    'output_map { key: "OUTPUT0" value: "mid" } }, '
    '{ model_name: "pass_b" model_version: -1 input_map { key: "INPUT0" value: "mid" } '
    'output_map { key: "OUTPUT0" value: "Y" } } ] }'
)


def _write_chain(repository: Path) -> None:
    for name in ("pass_a", "pass_b"):
        write_identity_model(repository, name)
    (repository / "chain" / "1").mkdir(parents=True)
    text = f'name: "chain"\nplatform: "ensemble"\nmax_batch_size: 8\n{CHAIN}\n'
    (repository / "chain" / "config.pbtxt").write_text(text)


def _check(trace: dict[str, Any], names: list[str], model: str = "simple") -> None:
    assert trace["model_name"] == model and trace["model_version"] == 1
    assert [name for name, _ in trace["timestamps"]] == names
    stamps = [ns for _, ns in trace["timestamps"]]
    assert stamps == sorted(stamps)  # one clock for the front-end and the core, whichever process each ran in


def start_traced(tmp_path: Path, repository: Path) -> tuple[GeserveProcess, Path]:
    """A server of `repository` that traces every request, with its timestamps, to a file in Triton's format
    (tmp_path/trace.json); and that file."""
    trace_file = tmp_path / "trace.json"
    server = GeserveProcess(
        tmp_path / "geserve.log",
        f"--model-repository={repository}",
        f"--trace-config=triton,file={trace_file}",
        "--trace-config=level=TIMESTAMPS",
        "--trace-config=rate=1",
    ).wait_live()
    return server, trace_file


def test_traces_go_to_the_file_in_tritons_format_and_rotate_by_log_frequency(tmp_path: Path) -> None:
    repository = tmp_path / "models"
    copy_model("simple", repository)
    _write_chain(repository)
    server, trace_file = start_traced(tmp_path, repository)
    try:
        http = httpclient.InferenceServerClient(server.url)
        grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        settings = http.get_trace_settings()
        assert settings["trace_file"] == str(trace_file) and settings["log_frequency"] == "0"
        grpc_settings = grpc.get_trace_settings(as_json=True)["settings"]
        assert grpc_settings["trace_file"]["value"] == [str(trace_file)]
        for index in range(2):
            _infer(http, httpclient, f"http-{index}")
            _infer(grpc, grpcclient, f"grpc-{index}")
        _stream_infer(grpc, "grpc-stream")
        chained = httpclient.InferInput("X", [1, 3], "FP32")
        chained.set_data_from_numpy(np.array([[1, 2, 3]], dtype=np.float32))
        result = http.infer("chain", [chained], request_id="ensemble")
        assert result.as_numpy("Y").tolist() == [[1, 2, 3]]
        with pytest.raises(InferenceServerException) as error:
            http.update_trace_settings(settings={"trace_file": str(tmp_path / "elsewhere.json")})
        assert error.value.message() == "trace file location can not be updated through network protocol"
        # A new log_frequency is a new setting: what the old one collected goes to the file, the next
        # traces to trace.json.<n> every 2 of them.
        assert http.update_trace_settings(settings={"log_frequency": "2"})["log_frequency"] == "2"
        assert grpc.get_trace_settings(as_json=True)["settings"]["log_frequency"]["value"] == ["2"]
        for index in range(2):
            _infer(http, httpclient, f"rotated-{index}")
        _infer(grpc, grpcclient, "left-over")
        assert http.get_trace_settings()["trace_file"] == str(trace_file)  # still serving after the refusal
        http.close()
        grpc.close()
    finally:
        assert server.stop() == 0, server.log()
    assert not (tmp_path / "elsewhere.json").exists()
    traces = _traces(trace_file)
    # An ensemble's steps are traces of their own, each naming the ensemble's its parent.
    (parent,) = [(key, trace) for key, trace in traces.items() if trace["model_name"] == "chain"]
    front, back = HTTP_NAMES[:2], HTTP_NAMES[-3:]
    _check(traces.pop(parent[0]), [*front, "REQUEST_START", "REQUEST_END", *back], model="chain")
    steps = {key: trace for key, trace in traces.items() if trace["parent_id"]}
    assert sorted(trace["model_name"] for trace in steps.values()) == ["pass_a", "pass_b"]
    for key, trace in steps.items():
        assert trace["parent_id"] == parent[0] and trace["request_id"] == "ensemble"
        _check(traces.pop(key), CORE[:-1], model=trace["model_name"])
    assert sorted(trace["request_id"] for trace in traces.values()) == [
        "grpc-0",
        "grpc-1",
        "grpc-stream",
        "http-0",
        "http-1",
    ]
    for trace in traces.values():
        _check(trace, HTTP_NAMES if trace["request_id"].startswith("http") else GRPC_NAMES)
    rotated = _traces(Path(f"{trace_file}.0"))
    assert sorted(trace["request_id"] for trace in rotated.values()) == ["rotated-0", "rotated-1"]
    for trace in rotated.values():
        _check(trace, HTTP_NAMES)
    # The one trace short of log_frequency is written at shutdown, to the next indexed file (as Triton's).
    left = _traces(Path(f"{trace_file}.1"))
    assert [trace["request_id"] for trace in left.values()] == ["left-over"]
    _check(next(iter(left.values())), GRPC_NAMES)
    assert not Path(f"{trace_file}.2").exists()
    ids = [parent[0], *steps, *traces, *rotated, *left]
    assert len(set(ids)) == len(ids) == 11
