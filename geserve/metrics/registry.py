"""Triton's metric families, from snapshots of the models' statistics, in an injected CollectorRegistry."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from prometheus_client.core import Metric
from prometheus_client.registry import Collector, CollectorRegistry

from geserve.core.api import HISTOGRAM_FAMILY, SUMMARY_FAMILIES, EngineAPI
from geserve.metrics.system import CpuUtilization, memory_bytes
from geserve.settings import MetricsSettings
from geserve.types import CacheSnapshot, CustomMetric, DeviceUsage, DurationSnapshot, VersionSnapshot

_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("nv_inference_request_success", "Number of successful inference requests, all batch sizes", "success"),
    ("nv_inference_count", "Number of inferences performed (does not include cached requests)", "inference_count"),
    (
        "nv_inference_exec_count",
        "Number of model executions performed (does not include cached requests)",
        "execution_count",
    ),
)
_INCLUDES_CACHED = "in microseconds (includes cached requests)"
_EXCLUDES_CACHED = "in microseconds (does not include cached requests)"
_LATENCY_COUNTERS = (
    ("nv_inference_request_duration_us", f"Cumulative inference request duration {_INCLUDES_CACHED}", "success"),
    ("nv_inference_queue_duration_us", f"Cumulative inference queuing duration {_INCLUDES_CACHED}", "queue"),
    (
        "nv_inference_compute_input_duration_us",
        f"Cumulative compute input duration {_EXCLUDES_CACHED}",
        "compute_input",
    ),
    (
        "nv_inference_compute_infer_duration_us",
        f"Cumulative compute inference duration {_EXCLUDES_CACHED}",
        "compute_infer",
    ),
    (
        "nv_inference_compute_output_duration_us",
        f"Cumulative inference compute output duration {_EXCLUDES_CACHED}",
        "compute_output",
    ),
)
_SUMMARY_HELP = {
    "request": "Summary of inference request duration in microseconds (includes cached requests)",
    "queue": "Summary of inference queuing duration in microseconds (includes cached requests)",
    "compute_input": "Summary of compute input duration in microseconds (does not include cached requests)",
    "compute_infer": "Summary of compute inference duration in microseconds (does not include cached requests)",
    "compute_output": "Summary of compute output duration in microseconds (does not include cached requests)",
}


# Per model, for versions that use the response cache: (name, help, hits or misses, count or duration).
_CACHE_COUNTERS = (
    ("nv_cache_num_hits_per_model", "Number of cache hits per model", 0, False),
    ("nv_cache_num_misses_per_model", "Number of cache misses per model", 1, False),
)
_CACHE_DURATIONS = (
    ("nv_cache_hit_duration_per_model", "Total cache hit duration per model, in microseconds", 0, True),
    (
        "nv_cache_miss_duration_per_model",
        "Total cache miss (insert+lookup) duration per model, in microseconds",
        1,
        True,
    ),
)
# The response cache as a whole, the gauges Triton's local cache publishes.
_CACHE_GAUGES = (
    ("nv_cache_num_entries", "Number of responses stored in response cache", "entries"),
    ("nv_cache_num_lookups", "Number of cache lookups in response cache", "lookups"),
    ("nv_cache_num_hits", "Number of cache hits in response cache", "hits"),
    ("nv_cache_num_misses", "Number of cache misses in response cache", "misses"),
    ("nv_cache_num_evictions", "Number of cache evictions in response cache", "evictions"),
    ("nv_cache_lookup_duration", "Total cache lookup duration (hit and miss), in microseconds", "lookup_ns"),
    ("nv_cache_insertion_duration", "Total cache insertion duration, in microseconds", "insertion_ns"),
    ("nv_cache_util", "Cache utilization [0.0 - 1.0]", "utilization"),
)


def _labels(version: VersionSnapshot) -> dict[str, str]:
    # prometheus-cpp prints labels sorted by name; metric_tags add `_<key>` labels.
    labels = {"model": version.name, "version": str(version.version)}
    labels.update({f"_{key}": value for key, value in version.metric_tags})
    return dict(sorted(labels.items()))


class TritonCollector(Collector):
    """Publishes the snapshot of the last `refresh` (taken just before each scrape): the numbers the
    statistics extension reports, under Triton's metric names."""

    def __init__(self, api: EngineAPI, config: MetricsSettings) -> None:
        self._api = api
        self._config = config
        self._cpu = CpuUtilization(config.interval_ms) if config.cpu_metrics else None
        self._versions: list[VersionSnapshot] = []
        self._device_usage: dict[int, DeviceUsage] = {}
        self._custom_series: list[CustomMetric] = []
        self._cache: CacheSnapshot | None = None

    async def refresh(self) -> None:
        """Read what the next `collect` publishes."""
        self._versions = await self._api.version_statistics()
        self._device_usage = await self._api.device_usage() if self._config.gpu_metrics else {}
        self._custom_series = await self._api.custom_metrics()
        self._cache = await self._api.cache_statistics()

    def collect(self) -> Iterator[Metric]:
        versions = [(version, _labels(version)) for version in self._versions]
        for name, documentation, field in _COUNTERS:
            metric = Metric(name, documentation, "counter")
            for version, labels in versions:
                metric.add_sample(name, labels, _count(version, field))
            yield metric
        failure = Metric(
            "nv_inference_request_failure", "Number of failed inference requests, all batch sizes", "counter"
        )
        for version, labels in versions:
            for reason, count in version.failures:
                reason_labels = dict(sorted({**labels, "reason": reason}.items()))
                failure.add_sample("nv_inference_request_failure", reason_labels, count)
        yield failure
        pending = Metric(
            "nv_inference_pending_request_count",
            "Instantaneous number of pending requests awaiting execution per-model.",
            "gauge",
        )
        for version, labels in versions:
            pending.add_sample("nv_inference_pending_request_count", labels, version.pending)
        yield pending
        if self._config.counter_latencies:
            for name, documentation, field in _LATENCY_COUNTERS:
                metric = Metric(name, documentation, "counter")
                for version, labels in versions:
                    metric.add_sample(name, labels, getattr(version, field).ns // 1000)
                yield metric
        load = Metric("nv_model_load_duration_secs", "Model load time in seconds", "gauge")
        for version, labels in versions:
            load.add_sample("nv_model_load_duration_secs", labels, version.load_duration_s)
        yield load
        fallback = Metric(
            "geserve_npu_fallback",
            "1 when a model version of backend 'ge' runs with ONNX Runtime instead of on an NPU (the repository index "
            "says why)",
            "gauge",
        )
        for version, labels in versions:
            fallback.add_sample("geserve_npu_fallback", labels, 1 if version.npu_fallback else 0)
        yield fallback
        yield from self._latency_metrics(versions)
        yield from self._cache_metrics(versions)
        yield from self._cpu_metrics()
        yield from self._device_metrics()
        yield from self._custom_metrics()

    def _latency_metrics(self, versions: list[tuple[VersionSnapshot, dict[str, str]]]) -> Iterator[Metric]:
        if self._config.summary_latencies:
            for family in SUMMARY_FAMILIES:
                documentation = _SUMMARY_HELP[family]
                name = f"nv_inference_{family}_summary_us"
                metric = Metric(name, documentation, "summary")
                for version, labels in versions:
                    for summary in version.summaries:
                        if summary.family != family:
                            continue
                        for quantile, value in summary.quantiles:
                            metric.add_sample(name, {**labels, "quantile": _number(quantile)}, value)
                        metric.add_sample(f"{name}_sum", labels, summary.sum_us)
                        metric.add_sample(f"{name}_count", labels, summary.count)
                yield metric
        if self._config.histogram_latencies:
            metric = Metric(HISTOGRAM_FAMILY, "Duration from request to first response in milliseconds", "histogram")
            for version, labels in versions:
                histogram = version.histogram
                if histogram is not None:
                    _histogram_samples(metric, labels, histogram.bounds_ms, histogram.cumulative, histogram.sum_ms)
            yield metric

    def _cache_metrics(self, versions: list[tuple[VersionSnapshot, dict[str, str]]]) -> Iterator[Metric]:
        """Triton's response cache families: per model for the versions that use the cache (all four only with
        the latency counters on, as Triton creates them with those), and the cache's own."""
        cached = [(version.cache, labels) for version, labels in versions if version.cache is not None]
        if cached and self._config.counter_latencies:
            for name, documentation, which, duration in _CACHE_COUNTERS + _CACHE_DURATIONS:
                metric = Metric(name, documentation, "counter")
                for pair, labels in cached:
                    value = pair[which]
                    metric.add_sample(name, labels, value.ns // 1000 if duration else value.count)
                yield metric
        if self._cache is None:
            return
        for name, documentation, field in _CACHE_GAUGES:
            value = getattr(self._cache, field)
            metric = Metric(name, documentation, "gauge")
            metric.add_sample(name, {}, value // 1000 if field.endswith("_ns") else value)
            yield metric

    def _cpu_metrics(self) -> Iterator[Metric]:
        if self._cpu is None:
            return
        total, used = memory_bytes()
        for name, documentation, value in (
            ("nv_cpu_utilization", "CPU utilization rate [0.0 - 1.0]", self._cpu.value()),
            ("nv_cpu_memory_total_bytes", "CPU total memory (RAM), in bytes", float(total)),
            ("nv_cpu_memory_used_bytes", "CPU used memory (RAM), in bytes", float(used)),
        ):
            metric = Metric(name, documentation, "gauge")
            metric.add_sample(name, {}, value)
            yield metric

    def _device_metrics(self) -> Iterator[Metric]:
        """NPUs under the names Triton uses for GPUs, with the single gpu_uuid label that dashboards
        and perf_analyzer --collect-metrics expect."""
        if not self._config.gpu_metrics:
            return
        usage = self._device_usage
        if not usage:
            return
        readings = [({"gpu_uuid": f"NPU-{device}"}, usage[device]) for device in sorted(usage)]
        utilization = Metric("nv_gpu_utilization", "GPU utilization rate [0.0 - 1.0)", "gauge")
        total = Metric("nv_gpu_memory_total_bytes", "GPU total memory, in bytes", "gauge")
        used = Metric("nv_gpu_memory_used_bytes", "GPU used memory, in bytes", "gauge")
        for labels, reading in readings:
            if reading.utilization is not None:
                utilization.add_sample("nv_gpu_utilization", labels, reading.utilization)
            total.add_sample("nv_gpu_memory_total_bytes", labels, float(reading.memory_total_bytes))
            used.add_sample("nv_gpu_memory_used_bytes", labels, float(reading.memory_used_bytes))
        if utilization.samples:
            yield utilization
        yield total
        yield used

    def _custom_metrics(self) -> Iterator[Metric]:
        """Families python models define with pb_utils.MetricFamily, as Triton exports them."""
        families: dict[str, Metric] = {}
        for series in self._custom_series:
            metric = families.get(series.family)
            if metric is None:
                metric = families[series.family] = Metric(series.family, series.description, series.kind)
            labels = dict(series.labels)
            if series.kind != "histogram":
                metric.add_sample(series.family, labels, series.value)
                continue
            cumulative = list(itertools.accumulate(series.bucket_counts))
            _histogram_samples(metric, labels, series.buckets, cumulative, series.sum)
        yield from families.values()


def _histogram_samples(
    metric: Metric, labels: dict[str, str], bounds: Sequence[float], cumulative: Sequence[int], total: float
) -> None:
    """`_bucket` per bound then +Inf (cumulative counts, `le` last as prometheus-cpp prints it), `_sum`, `_count`."""
    name = metric.name
    for bound, count in zip([*(_number(b) for b in bounds), "+Inf"], cumulative, strict=True):
        metric.add_sample(f"{name}_bucket", {**labels, "le": bound}, count)
    metric.add_sample(f"{name}_sum", labels, total)
    metric.add_sample(f"{name}_count", labels, cumulative[-1] if cumulative else 0)


def _count(version: VersionSnapshot, field: str) -> int:
    value = getattr(version, field)
    return value.count if isinstance(value, DurationSnapshot) else int(value)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def create_registry(api: EngineAPI, config: MetricsSettings) -> tuple[CollectorRegistry, TritonCollector]:
    """A fresh registry (never prometheus_client's global one) holding Triton's families, and the collector
    to refresh before each scrape."""
    registry = CollectorRegistry(auto_describe=False)
    collector = TritonCollector(api, config)
    registry.register(collector)
    return registry, collector
