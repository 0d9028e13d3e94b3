"""BLS call cycles the schedulers see: every instance of a version waits for a request queued behind them."""

from __future__ import annotations

from collections.abc import Iterable

from geserve.errors import UnsupportedError
from geserve.types import CallChain


def cycle_error(name: str, version: int, instances: int, chain: CallChain, where: str) -> UnsupportedError:
    """The error of a request in `chain` to a version whose every instance waits `where`."""
    path = " -> ".join(f"'{model}'" for model, _, _ in chain)
    return UnsupportedError(
        f"BLS call cycle: {path} -> '{name}'; every instance of model '{name}' version {version} ({instances}) "
        f"is waiting {where}, so the request could never run. Give the model more instances, or do not call it "
        "from itself"
    )


def self_waits(name: str, instances: frozenset[tuple[int, str]], queued: Iterable[CallChain]) -> bool:
    """Whether every one of `instances` ((version, instance name), all busy) of model `name` waits for one of
    the `queued` requests' chains: each of those requests came from it, so none of them can ever run."""
    callers = {
        (version, instance) for chain in queued if chain for model, version, instance in chain[-1:] if model == name
    }
    return bool(instances) and instances <= callers
