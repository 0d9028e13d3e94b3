"""BLS call chains: a request that only an instance already waiting for it could run is refused, not queued."""

from __future__ import annotations

from geserve.batching.cycles import cycle_error
from geserve.types import CallChain


def check_cycle(name: str, version: int, instances: int | None, chain: CallChain) -> None:
    """Refuse a BLS request to version `version` of model `name` when `chain` (the instances waiting, each in a
    BLS call, for this request) holds every one of its `instances` (None: not known, an ensemble's): each of them
    runs a batch that waits for this request, so it could never run. Triton queues such a request and it waits
    until its timeout, forever without one; here it fails at once, naming the cycle."""
    if instances is None or not chain:
        return
    waiting = {instance for model, number, instance in chain if (model, number) == (name, version)}
    if len(waiting) < instances:
        return
    raise cycle_error(name, version, instances, chain, "in this chain of calls")
