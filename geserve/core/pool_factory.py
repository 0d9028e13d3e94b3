"""What core needs to bring a model version's instances up: workers.pool.InstancePools, injected by the server."""

from __future__ import annotations

from typing import Protocol

from geserve._generated import model_config_pb2 as mc
from geserve.batching.sequence import SequenceInstances
from geserve.repository.scan import ModelSource


class PoolFactory(Protocol):
    """Builds started instance pools; core never sees a worker or a backend."""

    # Names of the shared-memory segments the instances use, which clients may not register.
    segment_prefix: str

    def complete(self, config: mc.ModelConfig, source: ModelSource, versions: list[int]) -> None:
        """Select the config's backend and fill the defaults it implies; raises ModelLoadError."""
        ...

    async def create(
        self, source: ModelSource, config: mc.ModelConfig, version: int
    ) -> tuple[SequenceInstances, mc.ModelConfig]:
        """Start the version's instances; the pool and the config they serve. Raises ModelLoadError."""
        ...
