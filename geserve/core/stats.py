"""Per model-version statistics: the one source of the statistics extension and the metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from geserve.core.latency import LatencyTracker
from geserve.types import DurationSnapshot, RequestTiming, VersionSnapshot

# nv_inference_request_failure reasons; every one is reported, even at zero.
FAILURE_REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")


@dataclass(slots=True)
class Duration:
    """A count and a cumulative duration, as Triton's StatisticDuration."""

    count: int = 0
    ns: int = 0

    def add(self, ns: int) -> None:
        self.count += 1
        self.ns += max(ns, 0)


@dataclass(slots=True)
class BatchDurations:
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


class ModelStats:
    """Counters of one model version, updated by its scheduler on the event loop (it implements
    the scheduler's StatsRecorder)."""

    def __init__(self) -> None:
        self.success = Duration()
        self.fail = Duration()
        self.queue = Duration()
        self.compute_input = Duration()
        self.compute_infer = Duration()
        self.compute_output = Duration()
        self.cache_hit = Duration()
        self.cache_miss = Duration()
        self.inference_count = 0
        self.execution_count = 0
        self.last_inference_ms = 0
        self.batch_stats: dict[int, BatchDurations] = {}
        self.failures = dict.fromkeys(FAILURE_REASONS, 0)
        self.pending = 0
        self.load_duration_s = 0.0
        # Observes every successful request's timing when latency summaries or histograms are on.
        self.latency: LatencyTracker | None = None

    def record_success(self, timing: RequestTiming) -> None:
        self.success.add(timing.total_ns)
        self.queue.add(timing.queue_ns)
        self.compute_input.add(timing.compute_input_ns)
        self.compute_infer.add(timing.compute_infer_ns)
        self.compute_output.add(timing.compute_output_ns)
        if self.latency is not None:
            self.latency(timing)

    def record_cache_hit(self, total_ns: int, lookup_ns: int) -> None:
        """A request answered from the response cache, as Triton counts it: a success (its queue and compute
        durations counted with no time), no inference and no execution."""
        self.success.add(total_ns)
        for duration in (self.queue, self.compute_input, self.compute_infer, self.compute_output):
            duration.add(0)
        self.cache_hit.add(lookup_ns)

    def record_cache_miss(self, miss_ns: int) -> None:
        """The lookup and insertion time of a request the model answered; Triton adds it to the request's duration."""
        self.success.ns += max(miss_ns, 0)
        self.cache_miss.add(miss_ns)

    def record_failure(self, reason: str, total_ns: int) -> None:
        self.fail.add(total_ns)
        self.failures[reason] += 1

    def snapshot(
        self,
        name: str,
        version: int,
        metric_tags: tuple[tuple[str, str], ...],
        cached: bool = False,
        npu_fallback: str = "",
    ) -> VersionSnapshot:
        """The counters now, as plain values (what the metrics publish); `cached`: with the response cache's."""
        latency = self.latency
        return VersionSnapshot(
            name,
            version,
            metric_tags,
            self.inference_count,
            self.execution_count,
            _snapshot(self.success),
            _snapshot(self.queue),
            _snapshot(self.compute_input),
            _snapshot(self.compute_infer),
            _snapshot(self.compute_output),
            tuple(self.failures.items()),
            self.pending,
            self.load_duration_s,
            latency.summary_snapshots() if latency is not None else (),
            latency.histogram_snapshot() if latency is not None else None,
            (_snapshot(self.cache_hit), _snapshot(self.cache_miss)) if cached else None,
            npu_fallback,
        )

    def record_execution(self, rows: int, input_ns: int, infer_ns: int, output_ns: int) -> None:
        """One model execution (one batch) of `rows` inferences."""
        self.execution_count += 1
        self.inference_count += rows
        self.last_inference_ms = time.time_ns() // 1_000_000
        batch = self.batch_stats.get(rows)
        if batch is None:
            batch = self.batch_stats[rows] = BatchDurations()
        batch.compute_input.add(input_ns)
        batch.compute_infer.add(infer_ns)
        batch.compute_output.add(output_ns)


def _snapshot(value: Duration) -> DurationSnapshot:
    return DurationSnapshot(value.count, value.ns)


def _duration(value: Duration) -> dict[str, int]:
    return {"count": value.count, "ns": value.ns}


def statistics_json(name: str, version: str, stats: ModelStats) -> dict[str, Any]:
    """One entry of `model_stats`, in the statistics extension's JSON form (also parsed into protobuf)."""
    return {
        "name": name,
        "version": version,
        "last_inference": stats.last_inference_ms,
        "inference_count": stats.inference_count,
        "execution_count": stats.execution_count,
        "inference_stats": {
            "success": _duration(stats.success),
            "fail": _duration(stats.fail),
            "queue": _duration(stats.queue),
            "compute_input": _duration(stats.compute_input),
            "compute_infer": _duration(stats.compute_infer),
            "compute_output": _duration(stats.compute_output),
            "cache_hit": _duration(stats.cache_hit),
            "cache_miss": _duration(stats.cache_miss),
        },
        "response_stats": {},
        "batch_stats": [
            {
                "batch_size": size,
                "compute_input": _duration(batch.compute_input),
                "compute_infer": _duration(batch.compute_infer),
                "compute_output": _duration(batch.compute_output),
            }
            for size, batch in sorted(stats.batch_stats.items())
        ],
        "memory_usage": [],
    }
