"""ScheduledRequest and ScheduledResponse: one request as a model version's scheduler takes and answers it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from geserve.residency import SharedTensor
from geserve.types import CallChain, Parameters


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """A validated request: its inputs (where their bytes lie, read only by the worker), the outputs it wants, its
    parameters (priority, timeout, sequence) and id. A BLS request carries the `chain` of calls it is part of."""

    inputs: Mapping[str, SharedTensor]
    output_names: tuple[str, ...]
    parameters: Parameters = field(default_factory=dict)
    request_id: str = ""
    chain: CallChain = ()  # a BLS request's: the instances waiting for it (types.CallChain)


class RequestTimestamps(NamedTuple):
    """When a request went through its batch (time.monotonic_ns, as the scheduler and workers take them)."""

    queue_start_ns: int
    compute_start_ns: int  # its batch went to an instance
    compute_input_end_ns: int  # the model started on the batch
    compute_output_start_ns: int  # the model finished
    compute_end_ns: int  # its outputs were back

    def marks(self) -> tuple[tuple[str, int], ...]:
        """The trace extension's timestamps, by Triton's names."""
        return (
            ("QUEUE_START", self.queue_start_ns),
            ("COMPUTE_START", self.compute_start_ns),
            ("COMPUTE_INPUT_END", self.compute_input_end_ns),
            ("COMPUTE_OUTPUT_START", self.compute_output_start_ns),
            ("COMPUTE_END", self.compute_end_ns),
        )

    def durations(self) -> tuple[int, int, int, int]:
        """Queue, compute input, compute infer and compute output, in ns (the statistics' split)."""
        return (
            self.compute_start_ns - self.queue_start_ns,
            max(self.compute_input_end_ns - self.compute_start_ns, 0),
            max(self.compute_output_start_ns - self.compute_input_end_ns, 0),
            max(self.compute_end_ns - self.compute_output_start_ns, 0),
        )


@dataclass(frozen=True, slots=True)
class ScheduledResponse:
    """A request's outputs (where the worker left them, held until their readers are done), and when it went through
    its batch (None: it ran as several, an ensemble's steps)."""

    outputs: dict[str, SharedTensor]
    timestamps: RequestTimestamps | None = None
