"""Supervisor: when a worker process dies, restart it with backoff, or give up on a crash loop."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """Backoff between restarts, and when a crash loop makes the instance give up."""

    first_delay_s: float = 0.5
    max_delay_s: float = 10.0
    max_crashes: int = 5
    crash_window_s: float = 60.0

    def delay(self, attempt: int) -> float:
        return float(min(self.first_delay_s * 2.0**attempt, self.max_delay_s))


# Start a fresh process: None once it is up, else why it could not load.
Respawn = Callable[[], Awaitable[str | None]]


class Supervisor:
    """Counts an instance's crashes and runs its restarts. `crashed` answers whether a restart is on its
    way; `on_up` and `on_give_up` report how it ended."""

    def __init__(
        self,
        name: str,
        policy: RestartPolicy,
        respawn: Respawn,
        on_up: Callable[[], None],
        on_give_up: Callable[[str], None],
    ) -> None:
        self._name = name
        self._policy = policy
        self._respawn = respawn
        self._on_up = on_up
        self._on_give_up = on_give_up
        self._crashes: collections.deque[float] = collections.deque()
        self._task: asyncio.Task[None] | None = None

    def crashed(self, reason: str) -> bool:
        """Record a crash; restart in the background unless the instance keeps crashing (then give up)."""
        now = time.monotonic()
        self._crashes.append(now)
        while self._crashes and now - self._crashes[0] > self._policy.crash_window_s:
            self._crashes.popleft()
        if len(self._crashes) >= self._policy.max_crashes:
            self._give_up(f"{reason}; it crashed {len(self._crashes)} times within {self._policy.crash_window_s:.0f}s")
            return False
        self._task = asyncio.get_running_loop().create_task(self._restart())
        return True

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def _give_up(self, reason: str) -> None:
        logger.error("giving up on instance %s: %s", self._name, reason)
        self._on_give_up(reason)

    async def _restart(self) -> None:
        attempt = len(self._crashes) - 1
        while True:
            await asyncio.sleep(self._policy.delay(attempt))
            failure = await self._respawn()
            if failure is None:
                self._on_up()
                return
            attempt += 1
            if attempt >= self._policy.max_crashes:
                self._give_up(f"restart failed: {failure}")
                return
