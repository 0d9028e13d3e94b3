"""InstanceLifecycle: a batched model version's instances through readiness, status reads and shutdown."""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from geserve.lifecycle import STOP_FLOOR_S
from geserve.types import InstanceStatus

logger = logging.getLogger(__name__)


class InstanceControl(Protocol):
    """A model version's instances outside the request path: whether they serve, what they report, and
    their end (workers.pool.InstancePool; an ensemble's steps stand for an ensemble's)."""

    def ready(self) -> bool:
        """An instance can take work, and its model says it is ready (python models' is_ready())."""
        ...

    async def read_statuses(self) -> list[InstanceStatus]:
        """What the instances report between batches (device usage, readiness, custom metrics)."""
        ...

    async def stop(self, timeout_s: float) -> None: ...

    def kill(self) -> None:
        """Stop at once, without draining."""
        ...


class Drains(Protocol):
    """A scheduler that can wait until every request it admitted has been answered."""

    async def drain(self) -> None: ...


class InstanceLifecycle:
    """The instances of a version that a scheduler feeds: stopping lets the requests the scheduler already
    admitted finish first (up to the timeout), then stops the instances."""

    def __init__(self, model_name: str, pool: InstanceControl, scheduler: Drains) -> None:
        self._model_name = model_name
        self._pool = pool
        self._scheduler = scheduler

    def ready(self) -> bool:
        return self._pool.ready()

    async def read_statuses(self) -> list[InstanceStatus]:
        return await self._pool.read_statuses()

    async def stop(self, timeout_s: float) -> None:
        """Within `timeout_s` in all, STOP_FLOOR_S of it kept for the workers (at least that, when less is left): a
        batch stuck in the model spends the timeout once, not once for the drain and again for the worker's exit."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            # A moment even when nothing is left of it: a scheduler with nothing in flight drains at once.
            await asyncio.wait_for(self._scheduler.drain(), max(timeout_s - STOP_FLOOR_S, 0.05))
        except TimeoutError:
            logger.warning("model '%s': batches still running at shutdown", self._model_name)
        await self._pool.stop(max(deadline - loop.time(), STOP_FLOOR_S))

    def kill(self) -> None:
        self._pool.kill()
