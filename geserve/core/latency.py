"""Latency summaries (sliding-window quantiles) and the first-response histogram of one model version."""

from __future__ import annotations

import bisect
import time
from collections import deque

import numpy as np

from geserve.core.api import SUMMARY_FAMILIES
from geserve.types import HistogramSnapshot, RequestTiming, SummarySnapshot

DEFAULT_BUCKETS_MS = (100.0, 500.0, 2000.0, 5000.0)

# Quantiles cover the last minute, as prometheus-cpp's summaries do by default.
WINDOW_NS = 60 * 1_000_000_000
WINDOW_MAX_SAMPLES = 8192


class LatencySummary:
    """Cumulative count and sum, and quantiles over a sliding window, in microseconds."""

    def __init__(self) -> None:
        self.count = 0
        self.sum_us = 0.0
        self._window: deque[tuple[int, float]] = deque(maxlen=WINDOW_MAX_SAMPLES)

    def observe(self, value_us: float, now_ns: int) -> None:
        self.count += 1
        self.sum_us += value_us
        self._window.append((now_ns, value_us))

    def quantiles(self, wanted: tuple[float, ...]) -> list[float]:
        if not wanted:
            return []
        cutoff = time.monotonic_ns() - WINDOW_NS
        while self._window and self._window[0][0] < cutoff:
            self._window.popleft()
        if not self._window:
            return [float("nan")] * len(wanted)
        values = np.fromiter((value for _, value in self._window), dtype=np.float64)
        return [float(q) for q in np.quantile(values, wanted)]


class FirstResponseHistogram:
    """Cumulative buckets of the time to a request's first (here: only) response, in ms."""

    def __init__(self, bounds_ms: tuple[float, ...]) -> None:
        self.bounds_ms = tuple(sorted(bounds_ms))
        self.bucket_counts = [0] * (len(self.bounds_ms) + 1)
        self.count = 0
        self.sum_ms = 0.0

    def observe(self, value_ms: float) -> None:
        self.bucket_counts[bisect.bisect_left(self.bounds_ms, value_ms)] += 1
        self.count += 1
        self.sum_ms += value_ms

    def cumulative(self) -> list[int]:
        totals, running = [], 0
        for count in self.bucket_counts:
            running += count
            totals.append(running)
        return totals


class LatencyTracker:
    """Observes one version's request timings; read as snapshots, computed here where the timings are."""

    def __init__(self, quantiles: tuple[float, ...] | None, histogram_bounds_ms: tuple[float, ...] | None) -> None:
        self._quantiles = quantiles or ()
        self.summaries = {family: LatencySummary() for family in SUMMARY_FAMILIES} if quantiles is not None else {}
        self.histogram = FirstResponseHistogram(histogram_bounds_ms) if histogram_bounds_ms else None

    def summary_snapshots(self) -> tuple[SummarySnapshot, ...]:
        return tuple(
            SummarySnapshot(
                family,
                tuple(zip(self._quantiles, summary.quantiles(self._quantiles), strict=True)),
                summary.sum_us,
                summary.count,
            )
            for family, summary in self.summaries.items()
        )

    def histogram_snapshot(self) -> HistogramSnapshot | None:
        histogram = self.histogram
        if histogram is None:
            return None
        return HistogramSnapshot(histogram.bounds_ms, tuple(histogram.cumulative()), histogram.sum_ms)

    def __call__(self, timing: RequestTiming) -> None:
        now = time.monotonic_ns()
        if self.summaries:
            for family, value_ns in (
                ("request", timing.total_ns),
                ("queue", timing.queue_ns),
                ("compute_input", timing.compute_input_ns),
                ("compute_infer", timing.compute_infer_ns),
                ("compute_output", timing.compute_output_ns),
            ):
                self.summaries[family].observe(value_ns / 1000, now)
        if self.histogram is not None:
            self.histogram.observe(timing.total_ns / 1e6)
