"""Trace mode opentelemetry in the engine: Triton's sampling and settings, and a finished trace as Triton's spans."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor

from geserve.core.trace import TraceController
from geserve.core.trace_otel import SpanExport, endpoint
from geserve.errors import InvalidArgumentError, UnsupportedError
from geserve.submissions import Submission
from geserve.types import InferRequest, TraceContext, TraceRecord

PARENT = "00-0af7651916cd43dd8448eb211c12666c-b7ad6b7169242424-01"
SETTINGS = {"trace_mode": "opentelemetry", "trace_level": ["TIMESTAMPS"]}


def _sampled(controller: TraceController, context: TraceContext | None = None, count: int = 1) -> list[bool]:
    return [controller.start("simple", "1", "", context) is not None for _ in range(count)]


def test_a_request_with_a_clients_context_is_traced_whatever_the_rate_and_count() -> None:
    controller = TraceController({**SETTINGS, "trace_rate": "3", "trace_count": "1"})
    assert _sampled(controller, count=3) == [False, False, True]  # the count is spent
    assert _sampled(controller, count=3) == [False] * 3
    forced = controller.start("simple", "1", "", TraceContext(PARENT, "k=v"))
    assert forced is not None and forced.finished().context == TraceContext(PARENT, "k=v")
    assert _sampled(controller, TraceContext("00-garbage-01"), 3) == [False] * 3  # an invalid one counts as none
    assert controller.settings()["trace_count"] == "0"


def test_rate_zero_at_startup_traces_only_requests_with_a_context() -> None:
    controller = TraceController({**SETTINGS, "trace_rate": "0"})
    assert _sampled(controller, count=5) == [False] * 5
    assert _sampled(controller, TraceContext(PARENT), 2) == [True, True]
    with pytest.raises(InvalidArgumentError, match="invalid value 0 for 'trace_rate'"):
        controller.update(None, {"trace_rate": "0"})  # as Triton: "sample rate must be non-zero" at runtime


def test_mode_triton_reads_no_context_and_level_off_traces_nothing() -> None:
    triton = TraceController({"trace_level": ["TIMESTAMPS"], "trace_rate": "1000"})
    assert _sampled(triton, TraceContext(PARENT), 3) == [False] * 3
    every = TraceController({"trace_level": ["TIMESTAMPS"], "trace_rate": "1"})
    trace = every.start("simple", "1", "", TraceContext(PARENT))
    assert trace is not None and trace.context is None
    off = TraceController({"trace_mode": "opentelemetry", "trace_level": ["OFF"]})
    assert _sampled(off, TraceContext(PARENT)) == [False]


def test_settings_shown_and_refused_in_mode_opentelemetry() -> None:
    controller = TraceController({**SETTINGS, "url": "collector:4318/v1/traces", "resource": ["a=b"]})
    assert controller.settings() == {
        "trace_level": ["TIMESTAMPS"],
        "trace_rate": "1000",
        "trace_count": "-1",
        "trace_mode": "opentelemetry",
        "url": "collector:4318/v1/traces",
        "resource": ["a=b"],
        "bsp_max_queue_size": "2048",
        "bsp_schedule_delay": "5000",
        "bsp_max_export_batch_size": "512",
    }
    assert controller.update("simple", {"trace_rate": "5"})["trace_rate"] == "5"
    assert controller.update(None, {"trace_mode": "opentelemetry"})["trace_mode"] == "opentelemetry"
    for change, message in (
        ({"url": "elsewhere:4318"}, "'url' can not be updated through network protocol"),
        ({"resource": None}, "'resource' can not be updated through network protocol"),
        ({"bsp_schedule_delay": "1"}, "'bsp_schedule_delay' can not be updated through network protocol"),
        ({"log_frequency": "2"}, "'log_frequency' is a setting of trace mode triton"),
        ({"trace_file": "x.json"}, "trace file location can not be updated through network protocol"),
        ({"trace_mode": "triton"}, "trace mode can not be changed while the server runs"),
    ):
        with pytest.raises(UnsupportedError, match=message):
            controller.update(None, change)
    triton = TraceController()
    with pytest.raises(UnsupportedError, match="'url' can not be updated through network protocol"):
        triton.update(None, {"url": "collector:4318"})
    with pytest.raises(UnsupportedError, match="trace mode can not be changed while the server runs"):
        triton.update(None, {"trace_mode": "opentelemetry"})


@pytest.mark.parametrize(
    ("traceparent", "valid"),
    [
        (PARENT, True),
        (" 00-0af7651916cd43dd8448eb211c12666c-b7ad6b7169242424-00 ", True),
        ("01-0af7651916cd43dd8448eb211c12666c-b7ad6b7169242424-01-later", True),
        ("00-0af7651916cd43dd8448eb211c12666c-b7ad6b7169242424-01-later", False),
        ("ff-0af7651916cd43dd8448eb211c12666c-b7ad6b7169242424-01", False),
        ("00-00000000000000000000000000000000-b7ad6b7169242424-01", False),
        ("00-0af7651916cd43dd8448eb211c12666c-0000000000000000-01", False),
        ("00-0AF7651916CD43DD8448EB211C12666C-b7ad6b7169242424-01", False),
        ("00-0af7651916cd43dd8448eb211c12666c-b7ad6b7169242424", False),
    ],
)
def test_w3c_traceparent(traceparent: str, valid: bool) -> None:
    assert (TraceContext(traceparent).span() is not None) is valid


def test_the_url_may_leave_out_the_scheme_as_tritons() -> None:
    assert endpoint("localhost:4318/v1/traces") == "http://localhost:4318/v1/traces"
    assert endpoint("https://collector/v1/traces") == "https://collector/v1/traces"


class Collected(SpanProcessor):
    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def on_end(self, span: ReadableSpan) -> None:
        self.spans.append(span)


def _export(record: TraceRecord, **settings: Any) -> list[ReadableSpan]:
    collected = Collected()
    values = {"bsp_max_queue_size": "1", "bsp_schedule_delay": "1", "bsp_max_export_batch_size": "1", **settings}
    SpanExport(values, collected).export(record)
    return collected.spans


STEP = (("REQUEST_START", 20), ("QUEUE_START", 21), ("COMPUTE_START", 22), ("COMPUTE_END", 23), ("REQUEST_END", 24))


def test_an_ensembles_trace_as_tritons_spans_under_the_clients() -> None:
    steps = (
        TraceRecord(8, "pass_a", "1", "ens", STEP, parent_id=7),
        TraceRecord(9, "pass_b", "2", "ens", tuple((name, ns + 10) for name, ns in STEP), parent_id=7),
    )
    marks = (("HTTP_RECV_START", 10), ("HTTP_RECV_END", 11), ("REQUEST_START", 19), ("REQUEST_END", 40))
    sent = (("INFER_RESPONSE_COMPLETE", 41), ("HTTP_SEND_START", 42), ("HTTP_SEND_END", 43))
    record = TraceRecord(7, "chain", "1", "ens", (*marks, *sent), None, 0, steps, TraceContext(PARENT, "k=v,bad"))
    exported = _export(record, resource=["service.name=test"])
    computes = [span for span in exported if span.name == "compute"]
    spans = {span.name: span for span in exported if span.name != "compute"}
    assert sorted(spans) == ["InferRequest", "chain", "pass_a", "pass_b"] and len(computes) == 2
    root, chain = spans["InferRequest"], spans["chain"]
    client = root.parent
    assert client is not None and client.is_remote
    assert (client.trace_id, client.span_id) == (int(PARENT.split("-")[1], 16), int(PARENT.split("-")[2], 16))
    assert chain.parent == root.context
    assert spans["pass_a"].parent == spans["pass_b"].parent == chain.context
    assert {span.context.trace_id for span in exported} == {client.trace_id}
    assert [event.name for event in root.events] == ["HTTP_RECV_START", "HTTP_RECV_END", *[name for name, _ in sent]]
    offset = root.events[0].timestamp - 10
    assert (root.start_time, root.end_time) == (10 + offset, 43 + offset)
    assert (chain.start_time, chain.end_time) == (19 + offset, 40 + offset)
    assert dict(spans["pass_b"].attributes) == {
        "triton.model_name": "pass_b",
        "triton.model_version": 2,
        "triton.trace_id": 9,
        "triton.trace_parent_id": 7,
        "triton.request_id": "ens",
    }
    assert [span.parent for span in computes] == [spans["pass_a"].context, spans["pass_b"].context]
    assert [event.name for event in computes[1].events] == ["COMPUTE_START", "COMPUTE_END"]
    assert (computes[1].start_time, computes[1].end_time) == (32 + offset, 33 + offset)
    assert root.resource.attributes["service.name"] == "test"
    assert root.instrumentation_scope is not None and root.instrumentation_scope.name == "triton-server"
    # An invalid tracestate is dropped, as OpenTelemetry's propagator does; the client's span still parents.
    assert not root.context.trace_state


def test_a_failed_requests_trace_without_a_context_starts_a_trace() -> None:
    record = TraceRecord(3, "raises", "1", "", (("REQUEST_START", 5), ("REQUEST_END", 9)))
    spans = {span.name: span for span in _export(record)}
    assert sorted(spans) == ["InferRequest", "raises"]
    assert spans["InferRequest"].parent is None and not spans["InferRequest"].events
    assert "triton.request_id" not in spans["raises"].attributes
    assert spans["InferRequest"].resource.attributes["service.name"] == "triton-inference-server"


def test_the_clients_context_crosses_processes_with_the_request_and_back_with_its_trace() -> None:
    """What a protocol process sends the engine (the Submission) and gets back (the Answer's TraceRecord) keep it."""
    context = TraceContext(PARENT, "k=v")
    submission = Submission("simple", "", 1, 0, (), ("OUTPUT0",), {}, "id", context)
    assert pickle.loads(pickle.dumps(submission)).trace_context == context
    request = InferRequest("simple", "", (), trace_context=context)
    assert pickle.loads(pickle.dumps(request)).trace_context == context
    record = TraceRecord(1, "simple", "1", "id", (("REQUEST_START", 1),), context=context)
    assert pickle.loads(pickle.dumps(record.around((), (("HTTP_SEND_END", 2),)))).context == context
