"""Accelerator memory and load, read through one instance per device, for the nv_gpu_* gauges."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from geserve.core.service import InferenceService
from geserve.types import DeviceUsage
from geserve.workers.client import WorkerClient

logger = logging.getLogger(__name__)


class DeviceMonitor:
    """Refreshes `usage` every interval from an instance on each device. Only worker processes may
    import the device runtime (pyACL), so the front-end asks them; a device with no instance on it
    has no reading."""

    def __init__(self, service: InferenceService, interval_s: float) -> None:
        self._service = service
        self._interval_s = interval_s
        self.usage: dict[int, DeviceUsage] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:
                logger.exception("reading device usage failed")
            await asyncio.sleep(self._interval_s)

    async def refresh(self) -> None:
        chosen: dict[int, WorkerClient] = {}
        for version in self._service.loaded_versions():
            for instance in version.instances:
                if instance.spec.on_device and instance.alive:
                    chosen.setdefault(instance.spec.device_id, instance)
        readings = await asyncio.gather(*(instance.read_device() for instance in chosen.values()))
        self.usage = {usage.device_id: usage for usage in readings if usage is not None}
