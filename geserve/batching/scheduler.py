"""The default scheduler: each request runs on its own on the next idle instance, in arrival order."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

import numpy as np

from geserve.errors import UnavailableError
from geserve.workers.client import WorkerClient
from geserve.workers.messages import Executed


class InstanceScheduler:
    """Hands each request to an idle instance; requests wait (FIFO) while all are busy."""

    def __init__(self, model_name: str, instances: Sequence[WorkerClient]) -> None:
        self._model_name = model_name
        self._instances = list(instances)
        self._idle: asyncio.Queue[WorkerClient] = asyncio.Queue()
        for instance in self._instances:
            self._idle.put_nowait(instance)

    @property
    def instances(self) -> list[WorkerClient]:
        return list(self._instances)

    def any_alive(self) -> bool:
        return any(instance.alive for instance in self._instances)

    async def execute(self, inputs: Mapping[str, np.ndarray], output_names: tuple[str, ...]) -> Executed:
        instance = await self._acquire()
        try:
            return await instance.execute(inputs, output_names)
        finally:
            self._idle.put_nowait(instance)

    async def _acquire(self) -> WorkerClient:
        while True:
            if not self.any_alive():
                raise UnavailableError(f"model '{self._model_name}' has no running instance")
            instance = await self._idle.get()
            if instance.alive:
                return instance
            if not self.any_alive():
                # Put the dead instance back so that every other waiter wakes up and fails too.
                self._idle.put_nowait(instance)
            # Otherwise drop it: live instances come back to the queue when they finish.
