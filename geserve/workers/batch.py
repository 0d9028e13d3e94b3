"""Batch: what a scheduler hands an instance to run, from the pool down to the worker client."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from geserve.residency import SharedTensor
from geserve.types import CallChain
from geserve.workers.messages import RequestInfo
from geserve.workers.streams import ResponseStream


class Cancellable(Protocol):
    """A request whose client may go away while its batch runs: the instance running it says what to do then
    (None once the batch is back: nothing any more). Registered after the client went already, it runs at once."""

    def on_cancel(self, callback: Callable[[], None] | None) -> None: ...


@dataclass(frozen=True, slots=True)
class Batch:
    """One batch of requests. Each input is given as the requests' row blocks, in request order (the worker
    gathers them where they lie); `output_names` is the union of the outputs the requests asked for. The
    requests whose index is in `streams` answer there (decoupled models), also after the batch has returned.
    The requests whose index is in `cancellable` answer with the batch; a backend that looks (a python model's
    `is_cancelled`) learns when their clients go away. `chain` tells the BLS calls its model makes meanwhile which
    instances already wait for them."""

    inputs: Mapping[str, Sequence[SharedTensor]]
    output_names: tuple[str, ...]
    requests: Sequence[RequestInfo]
    streams: Mapping[int, ResponseStream] = field(default_factory=dict)
    cancellable: Mapping[int, Cancellable] = field(default_factory=dict)
    chain: CallChain = ()  # the BLS calls its requests are part of, merged (types.merge_chains)
