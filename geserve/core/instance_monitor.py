"""Polls instances between batches: accelerator usage, the model's own readiness and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable

from geserve.core.models import ModelVersion
from geserve.types import CustomMetric, DeviceUsage, InstanceStatus

logger = logging.getLogger(__name__)


class InstanceMonitor:
    """Refreshes its readings every interval. Only worker processes may import what runs the model
    (pyACL, model.py), so the front-end asks them: one instance per device for device usage, and every
    instance that reports readiness or custom metrics (python models)."""

    def __init__(self, versions: Callable[[], list[ModelVersion]]) -> None:
        self._versions = versions
        self._interval_s = 2.0
        self.device_usage: dict[int, DeviceUsage] = {}
        self.custom_metrics: list[CustomMetric] = []
        self._task: asyncio.Task[None] | None = None

    def start(self, interval_s: float) -> None:
        self._interval_s = interval_s
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
                logger.exception("reading instance status failed")
            await asyncio.sleep(self._interval_s)

    async def refresh(self) -> None:
        per_version = await asyncio.gather(*(version.read_statuses() for version in self._versions()))
        usage: dict[int, DeviceUsage] = {}
        readings: list[InstanceStatus] = [status for statuses in per_version for status in statuses]
        for status in readings:
            if status.device is not None:
                usage.setdefault(status.device.device_id, status.device)
        self.device_usage = usage
        self.custom_metrics = merge_custom_metrics(status.metrics for status in readings)


def merge_custom_metrics(per_instance: Iterable[Iterable[CustomMetric]]) -> list[CustomMetric]:
    """One series per family and labels, as Triton's one registry holds it for all of a model's stubs: counters and
    histograms add up over the instances (each process counts its own share); a gauge is the value its instances
    set last."""
    merged: dict[tuple[str, tuple[tuple[str, str], ...]], CustomMetric] = {}
    for metrics in per_instance:
        for metric in metrics:
            key = (metric.family, metric.labels)
            seen = merged.get(key)
            if seen is None:
                merged[key] = metric
            elif metric.kind == "gauge":
                if metric.set_ns > seen.set_ns:
                    merged[key] = metric
            else:
                counts = tuple(a + b for a, b in zip(seen.bucket_counts, metric.bucket_counts, strict=False))
                merged[key] = CustomMetric(
                    seen.family, seen.description, seen.kind, seen.labels, seen.value + metric.value,
                    seen.buckets, counts, seen.sum + metric.sum,
                )  # fmt: skip
    return list(merged.values())
