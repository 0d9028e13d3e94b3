"""Submission and Answer: a request as the engine schedules it, and what the engine gives back: descriptors only."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from geserve.errors import GeserveError
from geserve.residency import SharedTensor
from geserve.types import Parameters, TraceContext, TraceRecord


@dataclass(frozen=True, slots=True)
class Submission:
    """A request checked against the version it addresses (`version`, its `load`) where it was decoded, its inputs
    placed in shared memory: the engine schedules it by these fields and never reads an input's bytes."""

    model_name: str
    requested_version: str  # as the client named it ("" for the latest ready one)
    version: int
    load: int
    inputs: tuple[tuple[str, SharedTensor], ...]
    output_names: tuple[str, ...]
    parameters: Parameters = field(default_factory=dict)
    request_id: str = ""
    # The client's W3C trace context, crossing to the engine with the request: there it may force the request's
    # sampling and parents its spans (trace mode opentelemetry), and comes back in the Answer's trace.
    trace_context: TraceContext | None = None

    def __reduce__(self) -> tuple[Callable[..., Submission], tuple[Any, ...]]:
        # One per request: a plain tuple of fields pickles several times faster than the dataclass.
        return Submission, (
            self.model_name,
            self.requested_version,
            self.version,
            self.load,
            self.inputs,
            self.output_names,
            dict(self.parameters),
            self.request_id,
            self.trace_context,
        )


@dataclass(frozen=True, slots=True)
class Answer:
    """One response: its outputs where the worker left them (held until the reader lets go of them), the version
    that answered, and the request's trace when it was sampled. A stream's responses each come as one, the last
    with `final`; a stream's own error comes as `error`."""

    outputs: dict[str, SharedTensor] | None  # None: a stream's final answer that carries no response
    model_version: str
    parameters: Parameters = field(default_factory=dict)
    trace: TraceRecord | None = None
    final: bool = True
    error: GeserveError | None = None

    def __reduce__(self) -> tuple[Callable[..., Answer], tuple[Any, ...]]:
        outputs = None if self.outputs is None else dict(self.outputs)
        fields = (outputs, self.model_version, dict(self.parameters), self.trace, self.final, self.error)
        return Answer, fields
