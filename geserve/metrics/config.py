"""--metrics-config: which latency families to publish and how."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from geserve.errors import InvalidArgumentError

DEFAULT_QUANTILES = ((0.5, 0.05), (0.9, 0.01), (0.95, 0.001), (0.99, 0.001), (0.999, 0.001))


def _bool(key: str, value: str) -> bool:
    lowered = value.lower()
    if lowered in ("true", "1"):
        return True
    if lowered in ("false", "0"):
        return False
    raise InvalidArgumentError(f"--metrics-config {key} must be true or false, got '{value}'")


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    """Triton's metrics settings; latency counters on, summaries and histograms off by default."""

    counter_latencies: bool = True
    summary_latencies: bool = False
    summary_quantiles: tuple[tuple[float, float], ...] = DEFAULT_QUANTILES
    histogram_latencies: bool = False
    interval_ms: int = 2000
    cpu_metrics: bool = True
    gpu_metrics: bool = True  # accelerators (NPUs) under Triton's nv_gpu_* names

    @classmethod
    def parse(
        cls, entries: Sequence[str], interval_ms: int = 2000, cpu_metrics: bool = True, gpu_metrics: bool = True
    ) -> MetricsConfig:
        """`key=value` entries as given to --metrics-config."""
        values: dict[str, object] = {"interval_ms": interval_ms, "cpu_metrics": cpu_metrics, "gpu_metrics": gpu_metrics}
        for entry in entries:
            key, separator, value = entry.partition("=")
            if not separator:
                raise InvalidArgumentError(f"--metrics-config expects key=value, got '{entry}'")
            if key in ("counter_latencies", "summary_latencies", "histogram_latencies"):
                values[key] = _bool(key, value)
            elif key == "summary_quantiles":
                values[key] = _quantiles(value)
            else:
                raise InvalidArgumentError(f"unknown --metrics-config key '{key}'")
        return cls(**values)  # type: ignore[arg-type]


def _quantiles(text: str) -> tuple[tuple[float, float], ...]:
    pairs = []
    for item in text.split(","):
        quantile, _, error = item.partition(":")
        try:
            pairs.append((float(quantile), float(error)))
        except ValueError:
            raise InvalidArgumentError(f"summary_quantiles expects quantile:error pairs, got '{item}'") from None
        if not 0.0 <= pairs[-1][0] <= 1.0:
            raise InvalidArgumentError(f"summary quantile {quantile} must be in [0, 1]")
    return tuple(pairs)
