"""Trace mode opentelemetry through tritonclient: Triton's spans at an OTLP/HTTP receiver, under the client's span."""

from __future__ import annotations

import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from tritonclient.utils import InferenceServerException

from tests.e2e.test_trace_file import _write_chain
from tests.support import GeserveProcess, copy_model

# Each layout is started here: the spans are the engine's to make, the context crosses from the protocol process.
pytestmark = [pytest.mark.e2e, pytest.mark.one_layout]

DATA = np.arange(16, dtype=np.int32).reshape(1, 16)
HTTP_PARENT = "00-0af7651916cd43dd8448eb211c12666c-b7ad6b7169242424-01"  # Triton's L0_trace test's context
GRPC_PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
ENSEMBLE_PARENT = (
    "00-5bf92f3577b34da6a3ce929d0e0e4736-10f067aa0ba902b7-00"  # not sampled by the client: traced all the same
)
STREAM_PARENT = "00-7bf92f3577b34da6a3ce929d0e0e4736-30f067aa0ba902b7-01"
FORCED_PARENT = "00-6bf92f3577b34da6a3ce929d0e0e4736-20f067aa0ba902b7-01"
HTTP_ROOT_EVENTS = ["HTTP_RECV_START", "HTTP_RECV_END", "INFER_RESPONSE_COMPLETE", "HTTP_SEND_START", "HTTP_SEND_END"]
GRPC_ROOT_EVENTS = [
    "GRPC_WAITREAD_START",
    "GRPC_WAITREAD_END",
    "INFER_RESPONSE_COMPLETE",
    "GRPC_SEND_START",
    "GRPC_SEND_END",
]
MODEL_EVENTS = ["REQUEST_START", "QUEUE_START", "REQUEST_END"]
COMPUTE_EVENTS = ["COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END"]


class Receiver:
    """An OTLP/HTTP trace receiver on a loopback port: POST /v1/traces with a protobuf ExportTraceServiceRequest."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.path != "/v1/traces" or self.headers["Content-Type"] != "application/x-protobuf":
                    self.send_response(404)
                    self.end_headers()
                    return
                with receiver._lock:
                    receiver.requests.append(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def spans(self) -> list[tuple[dict[str, Any], str, Span]]:
        """Every span received: its resource's attributes, its scope's name, the span."""
        with self._lock:
            return [
                (_attributes(resource.resource.attributes), scope.scope.name, span)
                for request in self.requests
                for resource in request.resource_spans
                for scope in resource.scope_spans
                for span in scope.spans
            ]

    def trace(self, trace_id: str, count: int, timeout_s: float = 60.0) -> list[Span]:
        """The `count` spans of one trace (hex id), once they have all come."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = [span for _, _, span in self.spans() if span.trace_id.hex() == trace_id]
            if len(found) >= count or time.monotonic() > deadline:
                assert len(found) == count, [span.name for span in found]
                return found
            time.sleep(0.05)

    def request(self, request_id: str, timeout_s: float = 60.0) -> Span:
        """The model span of the request with this id, once it has come."""
        deadline = time.monotonic() + timeout_s
        while True:
            for _, _, span in self.spans():
                if _attributes(span.attributes).get("triton.request_id") == request_id:
                    return span
            assert time.monotonic() < deadline, f"no span of request {request_id!r}"
            time.sleep(0.05)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _attributes(values: Any) -> dict[str, Any]:
    return {item.key: _value(item) for item in values}


def _value(item: KeyValue) -> Any:
    value: AnyValue = item.value
    return getattr(value, value.WhichOneof("value"))


def _inputs(module: Any) -> list[Any]:
    inputs = [module.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
    for tensor in inputs:
        tensor.set_data_from_numpy(DATA)
    return inputs


def _by_name(spans: list[Span]) -> dict[str, Span]:
    named = {span.name: span for span in spans}
    assert len(named) == len(spans), [span.name for span in spans]
    return named


def _events(span: Span) -> list[str]:
    return [event.name for event in span.events]


def _check_request(spans: list[Span], parent: str | None, root_events: list[str], request_id: str) -> None:
    """Triton's three spans of one request to `simple`: InferRequest under the client's span, the model's under it,
    compute under that; each with its events, the model's with Triton's attributes; each inside its parent's time."""
    named = _by_name(spans)
    assert sorted(named) == ["InferRequest", "compute", "simple"]
    root, model, compute = named["InferRequest"], named["simple"], named["compute"]
    assert root.parent_span_id.hex() == (parent.split("-")[2] if parent else "")
    assert model.parent_span_id == root.span_id and compute.parent_span_id == model.span_id
    assert {span.kind for span in spans} == {Span.SpanKind.SPAN_KIND_SERVER}
    assert _events(root) == root_events
    assert _events(model) == MODEL_EVENTS
    assert _events(compute) == COMPUTE_EVENTS
    attributes = _attributes(model.attributes)
    assert attributes == {
        "triton.model_name": "simple",
        "triton.model_version": 1,
        "triton.trace_id": attributes["triton.trace_id"],
        "triton.trace_parent_id": 0,
        "triton.request_id": request_id,
    }
    assert attributes["triton.trace_id"] > 0 and not _attributes(root.attributes)
    for outer, inner in ((root, model), (model, compute)):
        assert outer.start_time_unix_nano <= inner.start_time_unix_nano <= inner.end_time_unix_nano
        assert inner.end_time_unix_nano <= outer.end_time_unix_nano
    for span in spans:  # wall-clock time, as OpenTelemetry's, not the monotonic clock Triton's trace file has
        stamps = [event.time_unix_nano for event in span.events]
        assert (
            stamps == sorted(stamps) and span.start_time_unix_nano <= stamps[0] <= stamps[-1] <= span.end_time_unix_nano
        )
        assert abs(span.start_time_unix_nano - time.time_ns()) < 120 * 10**9


def _serve(tmp_path: Path, processes: int, receiver: Receiver) -> GeserveProcess:
    repository = tmp_path / "models"
    copy_model("simple", repository)
    _write_chain(repository)
    return GeserveProcess(
        tmp_path / "geserve.log",
        f"--model-repository={repository}",
        f"--frontend-processes={processes}",
        "--trace-config=mode=opentelemetry",
        f"--trace-config=opentelemetry,url=127.0.0.1:{receiver.port}/v1/traces",
        "--trace-config=opentelemetry,resource=service.name=geserve-test",
        "--trace-config=opentelemetry,resource=test.key=test.value",
        "--trace-config=opentelemetry,bsp_schedule_delay=50",
        "--trace-config=rate=1",
        "--trace-config=level=TIMESTAMPS",
    ).wait_live()


@pytest.mark.parametrize("processes", [1, 2])
def test_spans_reach_an_otlp_receiver_continuing_the_clients_trace(tmp_path: Path, processes: int) -> None:
    receiver = Receiver()
    server = _serve(tmp_path, processes, receiver)
    try:
        http = httpclient.InferenceServerClient(server.url)
        grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        settings = http.get_trace_settings()
        assert settings == {
            "trace_level": ["TIMESTAMPS"],
            "trace_rate": "1",
            "trace_count": "-1",
            "trace_mode": "opentelemetry",
            "url": f"127.0.0.1:{receiver.port}/v1/traces",
            "resource": ["service.name=geserve-test", "test.key=test.value"],
            "bsp_max_queue_size": "2048",
            "bsp_schedule_delay": "50",
            "bsp_max_export_batch_size": "512",
        }
        grpc_settings = grpc.get_trace_settings(as_json=True)["settings"]
        assert grpc_settings["trace_mode"]["value"] == ["opentelemetry"]
        assert grpc_settings["resource"]["value"] == ["service.name=geserve-test", "test.key=test.value"]
        assert "trace_file" not in grpc_settings and "log_frequency" not in grpc_settings
        http.infer("simple", _inputs(httpclient), request_id="http-1", headers={"traceparent": HTTP_PARENT})
        grpc_headers = {"traceparent": GRPC_PARENT, "tracestate": "vendor=value"}
        grpc.infer("simple", _inputs(grpcclient), request_id="grpc-1", headers=grpc_headers)
        chained = httpclient.InferInput("X", [1, 3], "FP32")
        chained.set_data_from_numpy(np.array([[1, 2, 3]], dtype=np.float32))
        http.infer("chain", [chained], request_id="ensemble", headers={"traceparent": ENSEMBLE_PARENT})
        http.infer("simple", _inputs(httpclient), request_id="own")
        answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
        grpc.start_stream(
            callback=lambda result, error: answers.put((result, error)), headers={"traceparent": STREAM_PARENT}
        )
        grpc.async_stream_infer("simple", _inputs(grpcclient), request_id="stream-1")
        assert answers.get(timeout=60)[1] is None
        grpc.stop_stream()

        _check_request(receiver.trace(HTTP_PARENT.split("-")[1], 3), HTTP_PARENT, HTTP_ROOT_EVENTS, "http-1")
        grpc_spans = receiver.trace(GRPC_PARENT.split("-")[1], 3)
        _check_request(grpc_spans, GRPC_PARENT, GRPC_ROOT_EVENTS, "grpc-1")
        assert {span.trace_state for span in grpc_spans} == {"vendor=value"}
        # A stream's metadata is every one of its requests' context.
        _check_request(receiver.trace(STREAM_PARENT.split("-")[1], 3), STREAM_PARENT, GRPC_ROOT_EVENTS, "stream-1")

        # An ensemble: its model span under InferRequest, each step's model span under the ensemble's.
        ensemble = receiver.trace(ENSEMBLE_PARENT.split("-")[1], 6)
        named = _by_name([span for span in ensemble if span.name != "compute"])
        computes = [span for span in ensemble if span.name == "compute"]
        assert sorted(named) == ["InferRequest", "chain", "pass_a", "pass_b"]
        assert named["InferRequest"].parent_span_id.hex() == ENSEMBLE_PARENT.split("-")[2]
        assert named["chain"].parent_span_id == named["InferRequest"].span_id
        assert _events(named["chain"]) == ["REQUEST_START", "REQUEST_END"]  # its steps queued, not it
        chain = _attributes(named["chain"].attributes)
        assert chain["triton.trace_parent_id"] == 0 and chain["triton.request_id"] == "ensemble"
        for step in ("pass_a", "pass_b"):
            assert named[step].parent_span_id == named["chain"].span_id
            assert _events(named[step]) == MODEL_EVENTS
            attributes = _attributes(named[step].attributes)
            assert attributes["triton.trace_parent_id"] == chain["triton.trace_id"]
            assert attributes["triton.model_name"] == step and attributes["triton.request_id"] == "ensemble"
        assert {span.parent_span_id for span in computes} == {named["pass_a"].span_id, named["pass_b"].span_id}

        # Without a context the request starts a trace of its own. (Its spans may come after the stream's: among
        # several protocol processes, the HTTP and the gRPC connection may be served by different ones.)
        own = receiver.request("own")
        client_ids = {parent.split("-")[1] for parent in (HTTP_PARENT, GRPC_PARENT, ENSEMBLE_PARENT, STREAM_PARENT)}
        assert own.trace_id.hex() not in client_ids
        _check_request(receiver.trace(own.trace_id.hex(), 3), None, HTTP_ROOT_EVENTS, "own")

        # Sampled every 1000th request now: one without a context is not traced, one with a context is (Triton's
        # force_sample), whatever the rate.
        assert http.update_trace_settings(settings={"trace_rate": "1000"})["trace_rate"] == "1000"
        http.infer("simple", _inputs(httpclient), request_id="unsampled")
        grpc.infer("simple", _inputs(grpcclient), request_id="forced", headers={"traceparent": FORCED_PARENT})
        _check_request(receiver.trace(FORCED_PARENT.split("-")[1], 3), FORCED_PARENT, GRPC_ROOT_EVENTS, "forced")

        # Mode opentelemetry's own settings, and the triton mode's, are not changed while the server runs.
        for change, message in (
            ({"url": "elsewhere:4318"}, "'url' can not be updated through network protocol"),
            ({"log_frequency": "2"}, "'log_frequency' is a setting of trace mode triton"),
            ({"trace_file": "x.json"}, "trace file location can not be updated through network protocol"),
            ({"trace_mode": "triton"}, "trace mode can not be changed while the server runs"),
        ):
            with pytest.raises(InferenceServerException) as error:
                http.update_trace_settings(settings=change)
            assert message in error.value.message()
        http.close()
        grpc.close()
    finally:
        status = server.stop()
        receiver.close()
    assert status == 0, server.log()
    resources = {(tuple(sorted(resource.items())), scope) for resource, scope, _ in receiver.spans()}
    assert len(resources) == 1
    ((attributes, scope),) = resources
    assert scope == "triton-server"
    assert {"service.name": "geserve-test", "test.key": "test.value"}.items() <= dict(attributes).items()
    unsampled = [span for _, _, span in receiver.spans() if span.name == "simple"]
    assert "unsampled" not in {_attributes(span.attributes).get("triton.request_id") for span in unsampled}
