"""Trace mode opentelemetry: each finished trace as Triton's spans, exported over OTLP/HTTP (the `otel` extra)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import NamedTuple

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags, TraceState

from geserve.types import TraceContext, TraceMark, TraceRecord

# Triton's names (triton-inference-server/server at e1db8a6, src/tracer.h and src/tracer.cc): its tracer
# (kTritonTracer, tracer.h:83), the span of the whole request (TraceManager::SampleTrace, tracer.cc:351), the
# compute span (Trace::AddEvent, tracer.cc:681; a model's span is named after the model, tracer.cc:679), and the
# service.name its resource has unless `resource` sets one (ProcessOpenTelemetryParameters, tracer.cc:505).
TRACER = "triton-server"
REQUEST_SPAN = "InferRequest"
COMPUTE_SPAN = "compute"
SERVICE_NAME = "triton-inference-server"
# Which span each timestamp is an event of, as Triton's: a model span has the request's core moments, and the
# compute span, its child, the compute ones (Trace::AddEvent, tracer.cc:655-697, opens the model span at
# REQUEST_START and closes it at REQUEST_END, the compute span from COMPUTE_START to COMPUTE_END); every other
# moment is the front-end's (HTTP_*, GRPC_*, INFER_RESPONSE_COMPLETE), which Trace::CaptureTimestamp
# (tracer.cc:378-407) adds to the InferRequest span.
_MODEL_EVENTS = frozenset(("REQUEST_START", "QUEUE_START", "REQUEST_END"))
_COMPUTE_EVENTS = frozenset(("COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END"))


def _batch_processor(settings: Mapping[str, list[str] | str]) -> SpanProcessor:
    """The batch span processor and its OTLP/HTTP exporter, as the settings describe them."""
    url = settings.get("url")
    # Without a url the exporter's own default, http://localhost:4318/v1/traces (Triton's), or
    # OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, which Triton's exporter reads too.
    exporter = OTLPSpanExporter(endpoint=endpoint(str(url)) if url else None)
    return BatchSpanProcessor(
        exporter,
        max_queue_size=int(str(settings["bsp_max_queue_size"])),
        schedule_delay_millis=int(str(settings["bsp_schedule_delay"])),
        max_export_batch_size=int(str(settings["bsp_max_export_batch_size"])),
    )


class _Trace(NamedTuple):
    """What every span of one trace shares: its OpenTelemetry trace id and trace state (the client's, when it sent
    them), and the wall clock's offset from time.monotonic_ns when the trace was exported."""

    trace_id: int
    state: TraceState
    offset: int


def endpoint(url: str) -> str:
    """The OTLP/HTTP endpoint `url` names. Triton's exporter (libcurl) takes `host:port/path` as http://; Python's
    HTTP client needs the scheme written out."""
    return url if "://" in url else f"http://{url}"


class SpanExport:
    """Triton's OpenTelemetry pipeline (TraceManager::InitTracer, tracer.cc:438-471): a batch span processor that
    exports over OTLP/HTTP on a thread of its own, so the event loop never waits on the collector. A trace's spans
    are made whole once it is finished, from the moments it took (time.monotonic_ns, turned into wall-clock time as
    Triton's time_offset_ does): span objects exist only for sampled requests. They are built as the SDK's finished
    spans and handed to the processor, as its tracer would once they end: the tracer's live spans (a lock per span,
    an event and an attribute at a time) cost ~10 times as much, on the engine's loop, for the same spans."""

    def __init__(self, settings: Mapping[str, list[str] | str], processor: SpanProcessor | None = None) -> None:
        """`settings` are the trace settings (mode opentelemetry's); `processor` where the spans go, by default the
        batch span processor and OTLP/HTTP exporter they describe."""
        attributes = {"service.name": SERVICE_NAME}
        resources = settings.get("resource", [])
        for entry in [resources] if isinstance(resources, str) else resources:
            key, _, value = entry.partition("=")
            attributes[key] = value
        # With OTEL_RESOURCE_ATTRIBUTES and the SDK's own (telemetry.sdk.*); the given ones win, as Triton's.
        self._resource = Resource.create(attributes)
        self._scope = InstrumentationScope(TRACER)
        self._ids = RandomIdGenerator()
        self._processor = processor if processor is not None else _batch_processor(settings)

    def export(self, record: TraceRecord) -> None:
        """One finished trace as spans: InferRequest (under the client's span, when it sent a valid context), its
        model's span, that one's compute span, and an ensemble's steps as model spans under the ensemble's."""
        if not record.timestamps:
            return
        client = _client_span(record.context) if record.context is not None else None
        trace = _Trace(
            client.trace_id if client is not None else self._ids.generate_trace_id(),
            client.trace_state if client is not None else TraceState(),
            time.time_ns() - time.monotonic_ns(),
        )
        stamps = [ns for _, ns in record.timestamps]
        front = [mark for mark in record.timestamps if mark[0] not in _MODEL_EVENTS and mark[0] not in _COMPUTE_EVENTS]
        # Triton's starts when the request is sampled and ends when its trace is released; geserve's spans the
        # request's moments, from the first (HTTP_RECV_START, GRPC_WAITREAD_START) to the last (the send's end).
        request = self._span(REQUEST_SPAN, trace, client, front, between=(min(stamps), max(stamps)))
        self._model_span(record, trace, request.context)
        self._processor.on_end(request)  # the parent last, as its children end before it

    def _model_span(self, record: TraceRecord, trace: _Trace, parent: SpanContext | None) -> None:
        """The span of one model's request with Triton's attributes (Trace::StartSpan, tracer.cc:538-587), its
        compute span, and an ensemble's steps' spans under it (a composing model's parent is the ensemble's span:
        tracer.cc:549-563)."""
        own = [mark for mark in record.timestamps if mark[0] in _MODEL_EVENTS]
        compute = [mark for mark in record.timestamps if mark[0] in _COMPUTE_EVENTS]
        if not own:
            return
        attributes: dict[str, str | int] = {
            "triton.model_name": record.model_name,
            # An int64 in Triton (TRITONSERVER_InferenceTraceModelVersion), as its trace file writes it too.
            "triton.model_version": int(record.model_version) if record.model_version.isdigit() else -1,
            "triton.trace_id": record.id,
            "triton.trace_parent_id": record.parent_id,
        }
        if record.request_id:
            attributes["triton.request_id"] = record.request_id
        between = (_first(own, "REQUEST_START"), _last(own, "REQUEST_END"))
        model = self._span(record.model_name, trace, parent, own, between=between, attributes=attributes)
        if compute:
            between = (compute[0][1], compute[-1][1])
            self._processor.on_end(self._span(COMPUTE_SPAN, trace, model.context, compute, between=between))
        for child in record.children:
            self._model_span(child, trace, model.context)
        self._processor.on_end(model)

    def _span(
        self,
        name: str,
        trace: _Trace,
        parent: SpanContext | None,
        events: list[TraceMark],
        *,
        between: tuple[int, int],
        attributes: Mapping[str, str | int] | None = None,
    ) -> ReadableSpan:
        """One finished span of kind SERVER, as Triton's (tracer.cc:595), from `between`'s
        first moment to its second. Every span is sampled (Triton's provider keeps the SDK's default AlwaysOn
        sampler), even under a client's span that was not: the trace settings, not the client, chose to trace it."""
        flags = TraceFlags(TraceFlags.SAMPLED)
        context = SpanContext(trace.trace_id, self._ids.generate_span_id(), False, flags, trace.state)
        return ReadableSpan(
            name,
            context,
            parent,
            self._resource,
            attributes or {},
            tuple(Event(event, None, ns + trace.offset) for event, ns in events),
            kind=SpanKind.SERVER,
            start_time=between[0] + trace.offset,
            end_time=between[1] + trace.offset,
            instrumentation_scope=self._scope,
        )

    def close(self) -> None:
        """Export the spans still queued and stop the processor's thread (blocks, up to the exporter's timeout)."""
        self._processor.shutdown()


def _client_span(context: TraceContext) -> SpanContext | None:
    """The client's span a W3C trace context names, as OpenTelemetry's TraceContextTextMapPropagator reads it (an
    invalid tracestate is dropped, the span kept); None when the traceparent names none."""
    span = context.span()
    if span is None:
        return None
    trace_id, span_id, flags = span
    state = TraceState.from_header([context.tracestate]) if context.tracestate else TraceState()
    return SpanContext(trace_id, span_id, True, TraceFlags(flags), state)


def _first(marks: list[TraceMark], name: str) -> int:
    return next((ns for mark, ns in marks if mark == name), marks[0][1])


def _last(marks: list[TraceMark], name: str) -> int:
    return next((ns for mark, ns in reversed(marks) if mark == name), marks[-1][1])
