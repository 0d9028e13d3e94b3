"""Running a model version's warmup samples on each of its instances, before the version serves."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from geserve.errors import GeserveError, ModelLoadError
from geserve.residency import SharedTensor
from geserve.workers.batch import Batch
from geserve.workers.messages import BatchResult, RequestInfo
from geserve.workers.streams import ResponseStream

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WarmupSample:
    """One `model_warmup` entry made ready to run: `batch_size` requests that all carry `inputs` (Triton gives
    each request of a sample the same data), run `count` times on every instance. A `decoupled` model's
    requests answer on streams, read to their final response."""

    name: str
    count: int
    batch_size: int
    inputs: Mapping[str, SharedTensor]
    output_names: tuple[str, ...]
    decoupled: bool = False

    def batch(self) -> Batch:
        """One run of the sample (a stream ends with its request: each run needs its own)."""
        inputs = {name: [tensor] * self.batch_size for name, tensor in self.inputs.items()}
        rows = 1  # a request of a batching model has batch dimension 1; one without has none
        requests = [RequestInfo(rows, self.output_names)] * self.batch_size
        streams = {index: ResponseStream() for index in range(self.batch_size)} if self.decoupled else {}
        return Batch(inputs, self.output_names, requests, streams)


class WarmupInstances(Protocol):
    """A version's instances, one at a time (workers.pool.InstancePool)."""

    @property
    def size(self) -> int: ...

    def dispatch_to(self, index: int, batch: Batch) -> Coroutine[Any, Any, BatchResult]: ...


async def warm_up(model_name: str, instances: WarmupInstances, samples: Sequence[WarmupSample]) -> None:
    """Run every sample `count` times on every instance (the instances side by side, each one's samples in
    order), straight to the instance as Triton does: no scheduler, so no statistics. The first failing sample
    fails the load with Triton's message."""
    if not samples:
        return
    results = await asyncio.gather(
        *(_warm_instance(model_name, instances, index, samples) for index in range(instances.size)),
        return_exceptions=True,
    )
    for result in results:
        if isinstance(result, BaseException):
            raise result


async def _warm_instance(
    model_name: str, instances: WarmupInstances, index: int, samples: Sequence[WarmupSample]
) -> None:
    for sample in samples:
        for iteration in range(1, sample.count + 1):
            logger.debug(
                "model '%s' instance %d is running warmup sample '%s' for iteration %d",
                model_name,
                index,
                sample.name,
                iteration,
            )
            batch = sample.batch()
            try:
                result = await instances.dispatch_to(index, batch)
            except GeserveError as error:  # the instance itself failed (its worker died)
                raise _failed(sample, [error.message]) from None
            errors = [item.message for item in result.results if isinstance(item, GeserveError)]
            for request, stream in batch.streams.items():
                if not isinstance(result.results[request], GeserveError):
                    errors += [error.message async for _, error, _ in stream.responses() if error is not None]
            if errors:
                raise _failed(sample, errors)


def _failed(sample: WarmupSample, errors: list[str]) -> ModelLoadError:
    # Triton's text: every failing request's error, each followed by "; ".
    return ModelLoadError(f"failed to run warmup sample '{sample.name}': " + "".join(f"{e}; " for e in errors))
